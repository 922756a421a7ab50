"""The expert placements of a TP plan (`parallel.plan._place_experts`): exact spans for the shapes
that matter, the stated fallback where the expert width cannot be cut, and the shard slices each
rank reads (`parallel.shard_load.slice_spec`)."""

import pytest

from tandem.parallel.apportion import Span
from tandem.parallel.plan import DegeneratePlanError, TPPlanError, make_tp_plan
from tandem.parallel.shard_load import slice_spec

QWEN3_30B_A3B = dict(
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
    n_experts=128,
    expert_width=768,
)


def test_width_768_in_k_quant_superblocks_splits_512_256_at_tp2():
    plan = make_tp_plan(world_size=2, experts_down_block=256, **QWEN3_30B_A3B)
    assert plan.moe == "tp" and plan.moe_fallback == ""
    assert plan.expert_rows == (Span(0, 512), Span(512, 768))
    assert plan.experts == (Span(0, 128), Span(0, 128))


def test_width_768_at_tp3_gives_each_rank_one_superblock():
    plan = make_tp_plan(world_size=3, experts_down_block=256, **QWEN3_30B_A3B)
    assert plan.expert_rows == (Span(0, 256), Span(256, 512), Span(512, 768))


def test_a_width_with_fewer_blocks_than_ranks_falls_back_to_whole_experts_and_says_why():
    plan = make_tp_plan(world_size=4, experts_down_block=256, **QWEN3_30B_A3B)
    assert plan.moe == "experts"
    assert "768 is 3 blocks of 256, fewer than the 4 ranks" in plan.moe_fallback
    assert plan.experts == tuple(Span(32 * r, 32 * (r + 1)) for r in range(4))
    assert plan.expert_rows == (Span(0, 768),) * 4


def test_whole_experts_are_apportioned_by_the_ranks_weights():
    plan = make_tp_plan(world_size=3, weights=(2.0, 1.0, 1.0), moe="experts", **QWEN3_30B_A3B)
    assert plan.experts == (Span(0, 64), Span(64, 96), Span(96, 128))


def test_expert_placement_refuses_unknown_modes_and_more_ranks_than_experts():
    with pytest.raises(TPPlanError, match="--moe 'rows'"):
        make_tp_plan(world_size=2, moe="rows", **QWEN3_30B_A3B)
    few = {**QWEN3_30B_A3B, "n_experts": 2}
    with pytest.raises(DegeneratePlanError, match="experts"):
        make_tp_plan(world_size=3, moe="experts", **few)


@pytest.mark.parametrize(
    "moe, name, want",
    [
        ("tp", "model.layers.3.mlp.experts.gate_proj.weight", (1, 512, 768)),
        ("tp", "model.layers.3.mlp.experts.up_proj.weight", (1, 512, 768)),
        ("tp", "model.layers.3.mlp.experts.down_proj.weight", (2, 512, 768)),
        ("experts", "model.layers.3.mlp.experts.gate_proj.weight", (0, 64, 128)),
        ("experts", "model.layers.3.mlp.experts.down_proj.weight", (0, 64, 128)),
        ("tp", "model.layers.3.mlp.gate.weight", None),
    ],
)
def test_each_rank_reads_its_rows_of_every_expert_or_its_experts(moe, name, want):
    plan = make_tp_plan(world_size=2, experts_down_block=256, moe=moe, **QWEN3_30B_A3B)
    assert slice_spec(name, plan, 1) == want
