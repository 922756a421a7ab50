"""Each rank's expert placement and bytes per token (`parallel.moe_reads`, `plan.experts`), and the
predictor under whole experts (`plan.model`)."""

from __future__ import annotations

import math

import pytest
from model_shapes import qwen3_30b_a3b

from tandem.config import ModelConfig
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.make import make_model_dir
from tandem.loaders.source import open_model
from tandem.parallel.moe_reads import rank_reads, source_bytes, uniform_bytes
from tandem.parallel.plan import plan_for_config, plan_for_source
from tandem.plan.experts import place_experts, render_placement
from tandem.plan.model import Layout, NodeSpec, layer_shares

TINY = ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-gpt-oss")


@pytest.fixture(scope="module", params=TINY)
def q8_file(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / f"{request.param}.gguf"
    return write_preset_gguf(out, request.param, "Q8_0")[1][0]


def _file_bytes(src, names) -> int:
    return sum(src.info(n).nbytes for n in names)


@pytest.mark.parametrize(("moe", "weights"), [("tp", None), ("experts", None), ("experts", (2, 1))])
def test_the_ranks_bytes_add_up_to_the_files_tensors(q8_file, moe, weights):
    """A Q8_0 file of each tiny MoE preset (8 experts, 2 active): over the ranks, the expert bytes
    held add up to the file's expert tensors, the expected expert bytes read to k / E = 2 / 8 of
    them; every rank reads the whole router; the attention bytes (TP=2: no kv head repeated)
    add up to the file's q/k/v/o tensors; a dense layer's MLP to its tensors. TP=2, equal and
    2:1 (whole experts 5 / 3). The file's sizes
    are `info().nbytes`, its blocks' own: not the formula under test."""
    src = open_model(q8_file)
    cfg, spec = src.config, src.config.moe
    tp = 2
    plan = plan_for_source(src, tp, weights, moe=moe)
    layers = range(cfg.num_hidden_layers)
    sparse = [i for i in layers if spec.is_sparse(i)]
    reads = [rank_reads(cfg, plan, r, (0, len(layers)), source_bytes(src)) for r in range(tp)]
    experts = _file_bytes(
        src, [f"model.layers.{i}.mlp.experts.{p}_proj.weight" for i in sparse for p in ("gate", "up", "down")]
    )  # fmt: skip
    router = _file_bytes(src, [f"model.layers.{i}.mlp.gate.weight" for i in sparse])
    assert sum(r.held_expert_bytes for r in reads) == pytest.approx(experts, rel=1e-12)
    assert sum(r.expert_bytes for r in reads) == pytest.approx(experts * 2 / 8, rel=1e-12)
    assert all(r.router_bytes == pytest.approx(router, rel=1e-12) for r in reads)
    assert [r.moe for r in reads] == [moe] * tp
    if moe == "experts":
        assert [r.groups for r in reads] == [
            (((e0, e1), (0, 64)),) for e0, e1 in (r.experts for r in reads)
        ]
        want = [(0, 4), (4, 8)] if weights is None else [(0, 5), (5, 8)]
        assert [r.experts for r in reads] == want
    dense = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in layers if not spec.is_sparse(i)
             for p in ("gate", "up", "down")]  # fmt: skip
    assert sum(r.dense_mlp_bytes for r in reads) == pytest.approx(_file_bytes(src, dense))
    attn = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in layers
            for p in ("q", "k", "v", "o")]  # fmt: skip
    assert sum(r.attention_bytes for r in reads) == pytest.approx(_file_bytes(src, attn))


# Qwen3-30B-A3B per layer, in elements: attention 2048 128 (2 32 + 2 4) = 18 874 368; router
# 128 2048 = 262 144; one expert 3 2048 768 = 4 718 592
ATTN, ROUTER, EXPERT, LAYERS = 18_874_368, 262_144, 4_718_592, 48


@pytest.mark.parametrize("moe", ["tp", "experts"])
def test_qwen3_30b_a3b_at_tp2_in_bfloat16(moe):
    """Qwen3-30B-A3B in bfloat16 (2 bytes) at TP=2: either placement reads per rank per token
    48 (ATTN / 2 + ROUTER + 4 EXPERT) 2 = 48 (9 437 184 + 262 144 + 18 874 368) 2 = 2.743 GB:
    under rows, 384 of 768 rows of each of the 8 chosen experts; under whole experts, 64 of the
    128 experts, so 8 64 / 128 = 4 of the chosen ones on average. Either holds half the experts:
    48 64 EXPERT 2 = 28.99 GB."""
    cfg = qwen3_30b_a3b()
    plan = plan_for_config(cfg, 2, moe=moe)
    for r in range(2):
        got = rank_reads(cfg, plan, r, (0, LAYERS), uniform_bytes(2))
        assert got.active_bytes == LAYERS * (ATTN // 2 + ROUTER + 4 * EXPERT) * 2
        assert got.active_bytes == pytest.approx(2.743e9, rel=1e-3)
        assert got.held_expert_bytes == LAYERS * 64 * EXPERT * 2
        assert got.active_experts == 4.0
    if moe == "experts":
        assert [got.experts for got in (rank_reads(cfg, plan, r, (0, 48), uniform_bytes(2))
                                        for r in range(2))] == [(0, 64), (64, 128)]  # fmt: skip


def test_qwen3_30b_a3b_whole_experts_at_3_to_1_in_q4_k():
    """Weights 3:1 under whole experts: 96 and 32 experts, so 8 96 / 128 = 6 and 2 of a token's 8
    on average; in Q4_K (144 bytes per 256 elements) rank 0 reads 48 6 EXPERT 144 / 256 =
    764.4 MB of experts per token and rank 1 254.8 MB; together 48 8 EXPERT 144 / 256, the whole
    model's expected expert read."""
    cfg = qwen3_30b_a3b()
    plan = plan_for_config(cfg, 2, (3.0, 1.0), moe="experts")
    q4k = uniform_bytes(144 / 256)
    a, b = (rank_reads(cfg, plan, r, (0, LAYERS), q4k) for r in range(2))
    assert (a.experts, b.experts) == ((0, 96), (96, 128))
    assert a.expert_bytes == pytest.approx(LAYERS * 6 * EXPERT * 144 / 256, rel=1e-12)
    assert b.expert_bytes == pytest.approx(LAYERS * 2 * EXPERT * 144 / 256, rel=1e-12)
    assert a.expert_bytes == pytest.approx(764.4e6, rel=1e-4)


def test_the_predictor_weighs_whole_experts_by_the_experts_a_rank_holds():
    """At 3:1 under whole experts the layer's read splits as the expert counts do: rank 0
    ATTN 3/4 + ROUTER + 6 EXPERT against rank 1's ATTN / 4 + ROUTER + 2 EXPERT (attention by kv
    heads at 3:1: 3 and 1 of the 4), over the whole layer ATTN + ROUTER + 8 EXPERT. An equal
    split is the rows' 0.5023 each (the router read on both). tiny-mixtral at 2:1: 5 / 3 whole
    experts against 11 / 5 blocks of rows (8 experts of 2 blocks of 32, dealt by weight), so the
    predicted shares differ by placement."""
    cfg = qwen3_30b_a3b()
    total = ATTN + ROUTER + 8 * EXPERT
    want = ((ATTN * 3 / 4 + ROUTER + 6 * EXPERT) / total, (ATTN / 4 + ROUTER + 2 * EXPERT) / total)
    assert layer_shares(cfg, 2, (3.0, 1.0), "experts") == pytest.approx(want, rel=1e-12)
    half = (ATTN / 2 + ROUTER + 4 * EXPERT) / total  # 0.5023: the router is on both ranks
    assert layer_shares(cfg, 2, None, "experts") == pytest.approx((half, half), rel=1e-12)
    tiny = open_model_config("tiny-mixtral")
    whole, rows = (layer_shares(tiny, 2, (2.0, 1.0), m) for m in ("experts", "tp"))
    assert whole[0] < rows[0] and whole[1] > rows[1]


def open_model_config(preset: str) -> ModelConfig:
    from tandem.models.presets import get_preset

    return get_preset(preset).config


def test_place_experts_follows_the_stages_and_the_weights():
    """`tandem plan`'s placement of a weighted TP=2 x PP=2 pick of tiny-qwen3-moe: nodes fastest
    first, stage-major; each stage's 8 experts split by its nodes' speeds; the stage's layers."""
    cfg = open_model_config("tiny-qwen3-moe")
    nodes = [NodeSpec("slow", 0.04), NodeSpec("fast", 0.01), NodeSpec("mid", 0.02),
             NodeSpec("mid2", 0.02)]  # fmt: skip
    p = place_experts(cfg, Layout(2, 2, weighted=True), (1, 2), nodes, "experts", uniform_bytes(4))
    assert [(r.rank, r.node, r.stage, r.layers) for r in p.ranks] == [
        (0, "fast", 0, (0, 1)), (1, "mid", 0, (0, 1)), (2, "mid2", 1, (1, 3)), (3, "slow", 1, (1, 3))
    ]  # fmt: skip
    assert [r.reads.experts for r in p.ranks] == [(0, 5), (5, 8), (0, 5), (5, 8)]
    text = render_placement(cfg, p, "in float32")
    assert "placed as whole experts" in text
    assert (
        "rank 3 (slow): stage 1 layers [1, 3) experts [5, 8) rows [0, 64) (3 experts, 100 %" in text
    )
    dense = place_experts(
        open_model_config("tiny-llama"), Layout(), (2,), nodes, "tp", uniform_bytes(2)
    )
    assert dense is None
    assert math.isclose(p.ranks[0].reads.active_experts, 2 * 5 / 8)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_hybrids_mixer_bytes_add_up_to_its_attention_and_deltanet_tensors(tmp_path, tp):
    """tiny-qwen35-moe (Gated DeltaNet layers among gated-attention ones, bfloat16): over the
    ranks, the mixer bytes read add up to the file's q/k/v/o tensors (q_proj's rows with their
    gates) of the attention layers and in_proj_qkv/z/a/b and out_proj of the DeltaNet layers."""
    make_model_dir(tmp_path, "tiny-qwen35-moe")
    src = open_model(tmp_path)
    cfg = src.config
    plan = plan_for_source(src, tp, None)
    reads = [rank_reads(cfg, plan, r, (0, cfg.num_hidden_layers), source_bytes(src))
             for r in range(tp)]  # fmt: skip
    names = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if cfg.is_linear(i):
            names += [f"{p}linear_attn.{t}.weight"
                      for t in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")]  # fmt: skip
        else:
            names += [f"{p}self_attn.{t}_proj.weight" for t in ("q", "k", "v", "o")]
    assert any(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
    assert sum(r.attention_bytes for r in reads) == pytest.approx(_file_bytes(src, names))
