"""Phi-3 / Phi-4-mini across real processes on loopback, against the single node in float32: the
fused qkv_proj / gate_up_proj read as row slices by each TP rank, partial rotary, a sliding window
of 20 and longrope switching to its long set past 32 tokens (every prompt + 32 new tokens crosses
both, the switch while decoding: the head rewinds the crossing sequence and every rank and stage
recomputes it). TP=2, TP=3 (kv heads replicated), a pipeline and a (TP=2, TP=1) grid give the
single node's greedy ids for 32 tokens at batch 1 and 3 and its first logits within 1e-4; a
Q8_0 GGUF (fused attn_qkv / ffn_up split into whole rows of blocks) at TP=2 matches its single
node step for step.
"""

from dataclasses import replace

import pytest
from family_support import (
    PROMPTS,
    assert_pipeline_and_grid_match,
    assert_single_node,
    expected_greedy,
    tp_groups,
)
from test_tp_gguf import assert_matches
from tp_support import greedy_steps, launch_concurrently

from tandem.engine.local import LocalExecutor
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset

LAYOUTS = {"tp2": (2, {}), "tp3": (3, {})}


def single_node(path, max_batch: int = 4, kernels: str = "auto") -> LocalExecutor:
    """The single node as users run it (its head rewinds a sequence crossing longrope's switch)."""
    model = load_model(open_model(path))
    return LocalExecutor(model, max_batch=max_batch, max_seq_len=128, kernels=kernels)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(model dir, single-node greedy at batch 1 and 3)."""
    d = tmp_path_factory.mktemp("phi3") / "m"
    config = replace(get_preset("tiny-phi3").config, sliding_window=20)
    make_model_dir(d, "tiny-phi3", config=config)
    ref = single_node(d)
    return d, expected_greedy(ref)


@pytest.fixture(scope="module")
def groups(phi3):
    with tp_groups(phi3[0], LAYOUTS) as started:
        yield started


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_parallel_phi3_matches_single_node_across_processes(groups, phi3, layout):
    assert_single_node(groups[layout], phi3[1])


def test_a_phi3_pipeline_and_grid_match_single_node(phi3):
    assert_pipeline_and_grid_match(phi3[0], phi3[1], cut=1, layers=2)


def test_a_phi3_q8_0_gguf_at_tp2_matches_single_node(tmp_path):
    """Each rank reads its whole-head rows of q, k, v and its rows of gate and up out of the
    fused blocks; the reference quantized modules everywhere, so only the partial sums' order
    differs."""
    c = replace(get_preset("tiny-phi3").config, hidden_size=128, intermediate_size=256)
    _, (file,) = write_preset_gguf(tmp_path / "phi3.gguf", "tiny-phi3", "Q8_0", config=c)
    ref = greedy_steps(single_node(file, 1, "torch"), PROMPTS[2], 30)
    started = launch_concurrently(
        {"tp2": (file, 2, {})}, max_batch=1, max_seq_len=128, threads=1, kernels="torch"
    )
    try:
        assert_matches(ref, greedy_steps(started["tp2"], PROMPTS[2], 30), "tp2")
    finally:
        started["tp2"].close()
