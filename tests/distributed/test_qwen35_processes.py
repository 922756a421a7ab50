"""The Qwen3.5 hybrid across real processes on loopback, against the single node in float32:
random-weight `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` saved by transformers (4 layers:
Gated DeltaNet on 0-2, gated attention with partial rotary on 3; 3 DeltaNet q/k heads of 8 serving
6 v heads of 12; 6 query heads on 3 kv heads; the MoE with a shared expert) at TP=2 (DeltaNet and
kv heads split 2/1), TP=3 (1/1/1), a pipeline of two stages cut inside the DeltaNet layers and a
(TP=2, TP=1) grid gives the single node's greedy ids for 32 tokens at batch 1 and 3 and its first
logits within ATOL; the single node's batch-1 ids are transformers' own. Each rank's DeltaNet
state is its own heads' (the shard description names them).

The same models as `qwen35` / `qwen35moe` GGUF files (tandem's writer in llama.cpp's converter
layout), whose DeltaNet v heads are stored tiled, at TP=2 and TP=3: each rank reads its q/k heads'
v heads as r = 2 runs of the file (`TPPlan.linear_v_spans`), and the groups give the single
node's greedy ids and first logits within ATOL on the same file. In F32; and in Q8_0 (v heads
of 16, so out_proj's 32-element blocks span two: the q/k heads go in pairs), where every rank
holds its DeltaNet in_proj rows and out_proj column runs as the file's blocks, on the reference
quantized modules as the single node it is held to, the bound of
tests/equivalence/test_qwen35_gguf.py (which holds that single node to transformers), so only the
partial sums' order differs. (The native kernels round activations to int8, where an order
difference of 1e-7 can flip one rounding: they are held to the reference by their own tests.)"""

import pytest
import torch
import transformers
from family_support import (
    assert_pipeline_and_grid_match,
    assert_single_node,
    expected_greedy,
    tp_groups,
    transformers_reference,
)
from hf_init import spread_
from llamacpp_recorded import CONVERTER_FILES, recorded
from tp_support import SingleNode, greedy

from tandem.engine.local import LocalExecutor
from tandem.engine.pp.launch import StageSpec, launch_pipeline
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.writer import write_model_dir_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.parallel.partition import LayerRange

LAYOUTS = {"tp2": (2, {}), "tp3": (3, {})}
# The recurrence carries each step's rounding into every later token's state: a TP group's other
# partial-sum order moves these first logits by up to 1.8e-4 on an AMD EPYC (AVX2 build: the Q8_0
# file at TP=2, the MoE's grid), within 1e-4 on a Sapphire Rapids; the greedy ids stay equal.
ATOL = 5e-4
SHAPE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=256,
    linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8,
    linear_value_head_dim=12, linear_conv_kernel_dim=4,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
           shared_expert_intermediate_size=40)  # fmt: skip


def hf_config(moe: bool, **over):
    """(transformers config, model class) of the test's shape, `over` replacing its fields."""
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**{**SHAPE, **over}, **MOE)
        return cfg, transformers.Qwen3_5MoeForCausalLM
    return transformers.Qwen3_5TextConfig(**{**SHAPE, **over}), transformers.Qwen3_5ForCausalLM


def hf_model(moe: bool):
    cfg, model_cls = hf_config(moe)
    torch.manual_seed(35)
    return spread_(model_cls(cfg).eval(), head_gain=2.0)


@pytest.fixture(scope="module", params=["dense", "moe"])
def qwen35(request, tmp_path_factory):
    """(model dir, single-node greedy at batch 1 and 3)."""
    d = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    return d, transformers_reference(hf_model(request.param == "moe"), d)


def test_tp2_and_tp3_match_single_node(qwen35):
    d, expected = qwen35
    with tp_groups(d, LAYOUTS) as groups:
        for name, ex in groups.items():
            shards = [r["shard"] for r in ex.describe()["ranks"]]
            want = [[0, 2], [2, 3]] if name == "tp2" else [[0, 1], [1, 2], [2, 3]]
            assert [s["linear_k_heads"] for s in shards] == want, name
            assert_single_node(ex, expected, ATOL)


def test_a_pipeline_and_a_grid_match_single_node(qwen35):
    assert_pipeline_and_grid_match(qwen35[0], qwen35[1], cut=2, layers=4, atol=ATOL)


def test_tp2_and_tp3_of_a_gguf_with_tiled_v_heads_match_single_node(qwen35):
    d, _ = qwen35
    (f,) = write_model_dir_gguf(d, d.parent / f"{d.name}-F32.gguf", "F32")
    expected = expected_greedy(SingleNode(f))
    assert SingleNode(f).model.config.deltanet.v_tiled
    with tp_groups(f, LAYOUTS) as groups:
        for name, ex in groups.items():
            shards = [r["shard"] for r in ex.describe()["ranks"]]
            want = [[0, 2], [2, 3]] if name == "tp2" else [[0, 1], [1, 2], [2, 3]]
            assert [s["linear_k_heads"] for s in shards] == want, name
            assert_single_node(ex, expected, ATOL)


@pytest.mark.parametrize("name", CONVERTER_FILES)
def test_tp2_and_a_pipeline_decode_llama_cpps_ids_on_the_converters_file(name):
    """The files llama.cpp's converter made (tests/equivalence/test_qwen35_converter_files.py)
    at TP=2 and over two stages cut inside the DeltaNet layers, across processes: llama.cpp's
    recorded greedy ids after both prompts decoding together."""
    f, prompts, want = recorded(name)
    with tp_groups(f, {"tp2": (2, {})}) as groups:
        assert greedy(groups["tp2"], prompts, len(want[0]), on_ranks=True)[0] == want
    stages = [StageSpec(LayerRange(0, 2)), StageSpec(LayerRange(2, 4))]
    ex = launch_pipeline(f, stages, max_batch=4, max_seq_len=128, timeout=30, threads=1)
    try:
        assert greedy(ex, prompts, len(want[0]), on_ranks=True)[0] == want
    finally:
        ex.close()


Q8_SHAPE = dict(linear_num_key_heads=6, linear_num_value_heads=12, linear_value_head_dim=16)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tp2_and_tp3_of_a_q8_0_gguf_hold_deltanet_blocks_and_match_single_node(moe, tmp_path):
    """6 q/k heads serving 12 v heads of 16: out_proj's 32-element blocks hold two v heads'
    columns, so the q/k heads go in pairs (`TPPlan.linear_align` 2): 4/2 at TP=2, 2/2/2 at
    TP=3; every rank's out_proj runs are whole blocks of the file."""
    d = tmp_path / "hf"
    cfg, model_cls = hf_config(moe, **Q8_SHAPE)
    torch.manual_seed(35)
    spread_(model_cls(cfg).eval(), head_gain=2.0).save_pretrained(d, safe_serialization=True)
    (f,) = write_model_dir_gguf(d, tmp_path / "m-Q8_0.gguf", "Q8_0")
    linear = {n: i for n, i in GGUFModel(f).manifest.items() if ".linear_attn." in n}
    for leaf in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"):
        assert linear[f"model.layers.0.linear_attn.{leaf}.weight"].quantized, leaf
    one = LocalExecutor(load_model(open_model(f)), max_batch=4, max_seq_len=128, kernels="torch")
    expected = expected_greedy(one)  # the reference modules over the blocks, as on every rank
    layouts = {k: (tp, {"kernels": "torch"}) for k, (tp, _) in LAYOUTS.items()}
    with tp_groups(f, layouts) as groups:
        for name, ex in groups.items():
            shards = [r["shard"] for r in ex.describe()["ranks"]]
            want = [[0, 4], [4, 6]] if name == "tp2" else [[0, 2], [2, 4], [4, 6]]
            assert [s["linear_k_heads"] for s in shards] == want, name
            assert_single_node(ex, expected, ATOL)
