"""Mixture-of-experts models (Qwen3-MoE with a dense layer among sparse ones, Qwen2-MoE with its
shared expert, Mixtral, gpt-oss with its biased experts, sinks and sliding-window layers) across
real processes on loopback, against the single-node reference in float32: every expert placement
of a TP group (rows of every expert at TP=2, TP=3 and weights 2:1; whole experts at 2 and 3 ranks)
and a pipeline and a (TP=2, TP=1) grid, of every family, give the single node's greedy ids for 32
tokens at batch 1 and 3, and its first logits within 1e-4; each rank's experts in the cluster view
are the ones its process loaded. A GGUF file with Qwen3-30B-A3B's expert width 768
in K-quants runs at TP=2 on its 3 superblocks an expert dealt evenly (half the experts 512 / 256,
the other half 256 / 512) and with whole experts. gpt-oss in
OpenAI's MXFP4 safetensors layout runs at TP=2 and on whole experts with its experts kept in their
blocks.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from family_support import (
    PROMPTS,
    assert_pipeline_and_grid_match,
    assert_single_node,
    expected_greedy,
    tp_groups,
)
from gguf_twin_support import compared_prefix, hf_greedy, mixtral_twin
from moe_support import LAYOUTS, assert_each_rank_shows_the_experts_it_loaded
from tp_support import SingleNode, close_concurrently, greedy_steps, launch_concurrently

from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.make import make_model_dir
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.parallel.expert_split import ExpertGroup
from tandem.parallel.plan import Span, plan_for_source


def G(e0: int, e1: int, r0: int, r1: int) -> ExpertGroup:
    return ExpertGroup(Span(e0, e1), Span(r0, r1))


FAMILIES = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-gpt-oss"]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"  # made by llama.cpp
_MADE: dict = {}


def _family(name: str, tmp_path_factory) -> tuple:
    """(model dir, number of layers, single-node greedy at batch 1 and 3), made once a module."""
    if name not in _MADE:
        d = tmp_path_factory.mktemp(name) / "m"
        config = make_model_dir(d, name)
        _MADE[name] = (d, config.num_hidden_layers, expected_greedy(SingleNode(d)))
    return _MADE[name]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=FAMILIES)
def groups(request, tmp_path_factory):
    """One family's five TP groups, started side by side (12 processes), closed before the next
    family's start."""
    fam = _family(request.param, tmp_path_factory)
    with tp_groups(fam[0], LAYOUTS) as started:
        yield fam, started


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_expert_placement_matches_single_node_across_processes(groups, layout):
    family, started = groups
    ex = started[layout]
    moe = LAYOUTS[layout][1].get("moe", "tp")
    assert ex.layout.moe == moe
    assert_single_node(ex, family[2])
    shards = [r["shard"] for r in ex.describe()["ranks"]]  # what /v1/cluster shows
    assert all(s["moe"] == moe for s in shards)
    if moe == "experts":  # whole experts, tiling [0, 8) in rank order
        assert [s["experts"][0] for s in shards] == sorted(s["experts"][0] for s in shards)
        assert shards[0]["experts"][0] == 0 and shards[-1]["experts"][1] == 8
    assert_each_rank_shows_the_experts_it_loaded(ex, family[0], moe)


def test_a_pipeline_and_a_grid_hold_whole_sparse_layers_and_match_single_node(family):
    """Also what the pipeline's cluster view says: each stage's ranks together hold every expert
    of the stage's sparse layers (the file's bytes), its TP=2 ranks half the rows each."""
    d, layers, expected = family
    md = open_model(d)
    spec = md.config.moe

    def held(a: int, b: int) -> int:
        return sum(
            md.info(f"model.layers.{i}.mlp.experts.{p}_proj.weight").nbytes
            for i in range(a, b) if spec.is_sparse(i) for p in ("gate", "up", "down")
        )  # fmt: skip

    def check(ex, stages):
        ranks = ex.describe()["ranks"]
        for k, st in enumerate(stages):
            mine = [r["experts"] for r in ranks if r["shard"].get("stage", 0) == k]
            assert len(mine) == st.tp
            assert sum(e["held_expert_bytes"] for e in mine) == held(st.layers.start, st.layers.end)
            assert [e["row_share"] for e in mine] == [1 / st.tp] * st.tp

    assert_pipeline_and_grid_match(d, expected, cut=1, layers=layers, check=check)


@pytest.fixture(scope="module")
def width_768_gguf(tmp_path_factory):
    """Qwen3-MoE in K-quants (Q4_K experts, Q5_K down_exps), experts 768 rows wide."""
    c = get_preset("tiny-qwen3-moe").config
    c = replace(
        c,
        hidden_size=256,
        num_attention_heads=8,
        head_dim=64,
        intermediate_size=512,
        moe=replace(c.moe, intermediate_size=768),
    )
    out = tmp_path_factory.mktemp("gguf") / "moe-768.gguf"
    return write_preset_gguf(out, "tiny-qwen3-moe", "K_MIX", config=c)[1][0]


def test_expert_width_768_in_k_quants_is_dealt_evenly_at_tp2(width_768_gguf):
    """3 superblocks an expert: experts [0, 4) give rank 0 two, experts [4, 8) rank 1."""
    plan = plan_for_source(open_model(width_768_gguf), 2)
    assert plan.moe == "tp" and plan.expert_groups == (
        (G(0, 4, 0, 512), G(4, 8, 0, 256)),
        (G(0, 4, 512, 768), G(4, 8, 256, 768)),
    )


def assert_tp2_and_experts2_match_single_node(file, prompt: list[int]) -> None:
    """The reference quantized modules on every rank and on the single node: the partials'
    float32 order is all that differs, so logits agree within 2e-3 and ids step for step."""
    from test_tp_gguf import SingleNode as GGUFSingleNode
    from test_tp_gguf import assert_matches

    ref = greedy_steps(GGUFSingleNode(file), prompt, 16)
    groups = launch_concurrently(
        {"tp2": (file, 2, {}), "experts2": (file, 2, {"moe": "experts"})},
        max_batch=1,
        max_seq_len=128,
        threads=1,
        kernels="torch",
    )
    try:
        for name, ex in groups.items():
            assert_matches(ref, greedy_steps(ex, prompt, 16), name)
    finally:
        close_concurrently(groups.values())


def test_a_k_quant_moe_file_at_tp2_and_on_whole_experts_matches_single_node(width_768_gguf):
    assert_tp2_and_experts2_match_single_node(width_768_gguf, PROMPTS[0])


def test_a_gpt_oss_mxfp4_file_made_by_llamacpp_at_tp2_and_on_whole_experts_matches_single_node():
    """llama.cpp's MXFP4_MOE file (tests/fixtures/gguf): the experts' MXFP4 blocks cut on
    32-element edges at TP=2, whole at 2 ranks; sinks and window layers sharded by head."""

    file = FIXTURES / "gpt-oss-mxfp4_moe.gguf"
    plan = plan_for_source(open_model(file), 2)
    assert plan.moe == "tp" and plan.expert_groups == ((G(0, 8, 0, 32),), (G(0, 8, 32, 64),))
    # 10 tokens + 16: past the sliding window of 8
    assert_tp2_and_experts2_match_single_node(file, PROMPTS[2])


def test_a_qwen2moe_file_made_by_llamacpp_at_tp2_and_on_whole_experts_matches_single_node():
    """llama.cpp's Qwen2-MoE Q8_0 file (tests/fixtures/gguf): q/k/v biases by head, the experts'
    rows 32 / 32 at TP=2 and 4 whole experts a rank, the shared expert's 128 rows 64 / 64 under
    both, its gate (one F32 row, stored as a vector) on every rank."""

    file = FIXTURES / "qwen2-moe-q8_0.gguf"
    plan = plan_for_source(open_model(file), 2)
    assert plan.moe == "tp" and plan.expert_groups == ((G(0, 8, 0, 32),), (G(0, 8, 32, 64),))
    assert plan.shared_rows == (Span(0, 64), Span(64, 128))
    assert_tp2_and_experts2_match_single_node(file, PROMPTS[0])


def assert_every_layout_follows(file: Path, hf, n: int = 16) -> None:
    """TP=2, TP=3, TP=2 at 2:1, whole experts at 2 and 3 ranks, PP=2 and a (TP=2, TP=1) grid,
    each across real processes on the reference quantized modules, give `hf`'s greedy ids for
    `n` tokens of PROMPTS[0], up to and including its first near-tie (`compared_prefix`)."""
    from tandem.engine.pp.launch import StageSpec, launch_pipeline
    from tandem.parallel.partition import LayerRange

    prompt = PROMPTS[0]
    want, gaps = hf_greedy(hf, prompt, n)
    k = compared_prefix(gaps)
    assert k >= 4, gaps  # enough steps to compare

    def ids(ex) -> list[int]:
        return [t for t, _ in greedy_steps(ex, prompt, n)]

    common = dict(max_batch=1, max_seq_len=64, threads=1, kernels="torch")
    groups = launch_concurrently(
        {name: (file, tp, kw) for name, (tp, kw) in LAYOUTS.items()}, **common
    )
    try:
        for name, ex in groups.items():
            assert ids(ex)[:k] == want[:k], name
    finally:
        close_concurrently(groups.values())
    for stages in (
        [StageSpec(LayerRange(0, 1)), StageSpec(LayerRange(1, 2))],
        [StageSpec(LayerRange(0, 1), tp=2), StageSpec(LayerRange(1, 2))],
    ):
        ex = launch_pipeline(file, stages, timeout=60, **common)
        try:
            assert ids(ex)[:k] == want[:k], [s.tp for s in stages]
        finally:
            ex.close()


def test_llamacpps_qwen3moe_q4_k_m_follows_transformers_reading_it_on_every_layout():
    """llama.cpp's converter and llama-quantize's Q4_K_M of a 256-wide Qwen3-MoE (tests/fixtures/
    gguf, `scripts/llamacpp_fixtures.py`) on every layout against transformers reading the same
    file (`gguf_file=`)."""
    import transformers

    from tandem.loaders.gguf.model_file import GGUFModel

    file = FIXTURES / "qwen3-moe-q4_k_m.gguf"
    width = GGUFModel(file).metadata.get("qwen3moe.expert_feed_forward_length", int)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, moe_intermediate_size=width
    ).eval()
    assert_every_layout_follows(file, hf)


def test_llamacpps_mixtral_q8_0_follows_transformers_on_gguf_pys_tensors_on_every_layout():
    """llama.cpp's converter and llama-quantize's Q8_0 of a Mixtral (a `llama` file with
    `ffn_*_exps`, which transformers' GGUF reader does not take: its MixtralForCausalLM over the
    tensors gguf-py dequantizes, `gguf_twin_support.mixtral_twin`) on every layout."""
    file = FIXTURES / "mixtral-q8_0.gguf"
    assert_every_layout_follows(file, mixtral_twin(file))


def test_a_gpt_oss_mxfp4_checkpoint_at_tp2_and_on_whole_experts_matches_single_node(
    tmp_path_factory,
):
    """OpenAI's MXFP4 layout in safetensors (`tiny-gpt-oss-mxfp4`): at TP=2 each rank repacks its
    32 of the 64 rows of every expert (gate/up from the file's interleaved rows) and its 32-column
    blocks of down; with `--moe experts` its 4 whole experts. Every rank and the single node on
    the reference quantized modules: 32 greedy ids at batch 1 and 3, first logits within 1e-4."""
    from tandem.engine.local import LocalExecutor
    from tandem.loaders.load import load_model
    from tandem.loaders.mxfp4_dir import Mxfp4ModelDir

    d = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "m"
    make_model_dir(d, "tiny-gpt-oss-mxfp4")
    src = open_model(d)
    assert isinstance(src, Mxfp4ModelDir)
    plan = plan_for_source(src, 2)
    assert plan.moe == "tp" and plan.expert_groups == ((G(0, 8, 0, 32),), (G(0, 8, 32, 64),))
    single = LocalExecutor(load_model(src), max_batch=4, max_seq_len=128, kernels="torch")
    expected = expected_greedy(single)
    groups = launch_concurrently(
        {"tp2": (d, 2, {}), "experts2": (d, 2, {"moe": "experts"})},
        max_batch=4,
        max_seq_len=128,
        threads=1,
        kernels="torch",
    )
    try:
        for name, ex in groups.items():
            assert_single_node(ex, expected)
            shards = [r["shard"] for r in ex.describe()["ranks"]]
            if name == "experts2":
                assert [s["experts"] for s in shards] == [[0, 4], [4, 8]]
            assert all("MXFP4" in r["weight_format"] for r in ex.describe()["ranks"])
    finally:
        close_concurrently(groups.values())
