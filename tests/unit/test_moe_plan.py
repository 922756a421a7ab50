"""The expert placements of a TP plan (`parallel.plan._place_experts`, `parallel.expert_split`):
exact groups and rows for the shapes that matter, each rank's expert rows within one block per
expert group of its weight's share, and the shard slices each rank reads
(`parallel.shard_load.slice_spec`)."""

import pytest

from tandem.parallel.apportion import Span
from tandem.parallel.expert_split import ExpertGroup
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


def G(e0: int, e1: int, r0: int, r1: int) -> ExpertGroup:
    return ExpertGroup(Span(e0, e1), Span(r0, r1))


def test_width_768_in_k_quant_superblocks_deals_512_256_and_256_512_at_tp2():
    """3 superblocks an expert: half the experts give rank 0 two, the other half rank 1."""
    plan = make_tp_plan(world_size=2, experts_down_block=256, **QWEN3_30B_A3B)
    assert plan.moe == "tp" and plan.expert_align == 256
    assert plan.expert_groups == (
        (G(0, 64, 0, 512), G(64, 128, 0, 256)),
        (G(0, 64, 512, 768), G(64, 128, 256, 768)),
    )
    assert [plan.held_expert_rows(r) for r in range(2)] == [128 * 384] * 2
    assert [plan.n_held_experts(r) for r in range(2)] == [128, 128]


def test_width_768_at_tp3_gives_each_rank_one_superblock_of_every_expert():
    plan = make_tp_plan(world_size=3, experts_down_block=256, **QWEN3_30B_A3B)
    assert plan.expert_groups == (
        (G(0, 128, 0, 256),),
        (G(0, 128, 256, 512),),
        (G(0, 128, 512, 768),),
    )


def test_width_768_at_tp4_gives_each_expert_to_three_ranks_and_each_rank_a_quarter():
    """Where every rank cannot hold a block of every expert, each holds one of 3 of every 4."""
    plan = make_tp_plan(world_size=4, experts_down_block=256, **QWEN3_30B_A3B)
    assert plan.moe == "tp"
    assert plan.expert_groups == (
        (G(0, 96, 0, 256),),
        (G(0, 64, 256, 512), G(96, 128, 0, 256)),
        (G(0, 32, 512, 768), G(64, 128, 256, 512)),
        (G(32, 128, 512, 768),),
    )
    assert [plan.held_expert_rows(r) for r in range(4)] == [96 * 256] * 4


@pytest.mark.parametrize(
    "n, weights, width, align",
    [
        (2, None, 768, 256),
        (2, (2.0, 1.0), 768, 256),
        (3, (3.0, 2.0, 1.0), 768, 256),
        (4, None, 768, 256),
        (5, (1.0, 1.5, 2.0, 1.0, 3.0), 1536, 256),
        (3, None, 64, 32),
        (2, (2.0, 1.0), 64, 32),
    ],
)
def test_every_expert_is_tiled_and_each_rank_holds_its_weights_share_within_a_block(
    n, weights, width, align
):
    """Every expert's rows tile [0, width) over the ranks in rank order, each rank's groups share
    no expert, and its blocks over all experts are apportion(E u, weights): within one block of
    E u w_r / sum(w) (the groups' count stays at most N)."""
    E = 128
    shape = {**QWEN3_30B_A3B, "n_experts": E, "expert_width": width}
    plan = make_tp_plan(world_size=n, weights=weights, experts_down_block=align, **shape)
    w = weights or (1.0,) * n
    units = width // align
    for e in range(E):
        rows = [g.rows for r in range(n) for g in plan.expert_groups[r] if e in g.experts]
        assert rows[0].start == 0 and rows[-1].end == width
        assert all(a.end == b.start for a, b in zip(rows, rows[1:]))
    for r in range(n):
        held = [e for g in plan.expert_groups[r] for e in g.experts]
        assert len(held) == len(set(held)) == plan.n_held_experts(r)
        quota = E * units * w[r] / sum(w)
        assert abs(plan.held_expert_rows(r) / align - quota) < 1
        assert len(plan.expert_groups[r]) <= n


def test_a_width_that_leaves_a_rank_no_rows_is_refused_by_name():
    few = {**QWEN3_30B_A3B, "n_experts": 2, "expert_width": 256}  # 2 blocks for 3 ranks
    with pytest.raises(DegeneratePlanError, match=r"leave rank\(s\) \[2\] with no expert rows"):
        make_tp_plan(world_size=3, experts_down_block=256, **few)


def test_whole_experts_are_apportioned_by_the_ranks_weights():
    plan = make_tp_plan(world_size=3, weights=(2.0, 1.0, 1.0), moe="experts", **QWEN3_30B_A3B)
    assert plan.expert_groups == ((G(0, 64, 0, 768),), (G(64, 96, 0, 768),), (G(96, 128, 0, 768),))


def test_expert_placement_refuses_unknown_modes_and_more_ranks_than_experts():
    with pytest.raises(TPPlanError, match="--moe 'rows'"):
        make_tp_plan(world_size=2, moe="rows", **QWEN3_30B_A3B)
    few = {**QWEN3_30B_A3B, "n_experts": 2}
    with pytest.raises(DegeneratePlanError, match="experts"):
        make_tp_plan(world_size=3, moe="experts", **few)


@pytest.mark.parametrize(
    "moe, name, want",
    [
        ("tp", "model.layers.3.mlp.experts.gate_proj.weight", (1, 512, 768, (0, 64))),
        ("tp", "model.layers.3.mlp.experts.up_proj.weight", (1, 512, 768, (0, 64))),
        ("tp", "model.layers.3.mlp.experts.down_proj.weight", (2, 512, 768, (0, 64))),
        ("tp", "model.layers.3.mlp.expert_groups.1.gate_proj.weight", (1, 256, 768, (64, 128))),
        ("tp", "model.layers.3.mlp.expert_groups.1.down_proj.weight", (2, 256, 768, (64, 128))),
        ("tp", "model.layers.3.mlp.expert_groups.1.up_proj.bias", (1, 256, 768, (64, 128))),
        ("tp", "model.layers.3.mlp.expert_groups.1.down_proj.bias", (0, 64, 128)),
        ("experts", "model.layers.3.mlp.experts.gate_proj.weight", (0, 64, 128)),
        ("experts", "model.layers.3.mlp.experts.down_proj.weight", (0, 64, 128)),
        ("tp", "model.layers.3.mlp.gate.weight", None),
    ],
)
def test_each_rank_reads_its_rows_of_each_group_of_experts_or_its_experts(moe, name, want):
    plan = make_tp_plan(world_size=2, experts_down_block=256, moe=moe, **QWEN3_30B_A3B)
    assert slice_spec(name, plan, 1) == want
