import pytest

from tandem.parallel.apportion import Span
from tandem.parallel.plan import (
    DegeneratePlanError,
    TPPlanError,
    WeightsParseError,
    choose_align,
    make_tp_plan,
    parse_weights,
    split_by_weights,
)


def _ranges(shards):
    return [(s.start, s.end) for s in shards]


def test_equal_split_gives_extra_units_to_lower_ranks():
    assert _ranges(split_by_weights(8, (1, 1, 1))) == [(0, 3), (3, 6), (6, 8)]
    assert _ranges(split_by_weights(10, (1, 1))) == [(0, 5), (5, 10)]
    assert _ranges(split_by_weights(7, (1,))) == [(0, 7)]


def test_weighted_split_is_proportional():
    assert _ranges(split_by_weights(9, (2, 1))) == [(0, 6), (6, 9)]
    assert _ranges(split_by_weights(8, (2, 1))) == [(0, 5), (5, 8)]
    assert _ranges(split_by_weights(3072, (2, 1), 64)) == [(0, 2048), (2048, 3072)]
    assert _ranges(split_by_weights(100, (1, 2, 1), 10)) == [(0, 30), (30, 80), (80, 100)]


@pytest.mark.parametrize(
    "total,weights,align",
    [(8, (1, 1, 1), 1), (3072, (3, 1, 1, 2), 64), (151936, (2.5, 1), 64), (17, (1, 9, 2), 1)],
)
def test_split_is_contiguous_disjoint_and_complete(total, weights, align):
    shards = split_by_weights(total, weights, align)
    assert shards[0].start == 0 and shards[-1].end == total
    for a, b in zip(shards, shards[1:]):
        assert a.end == b.start
    assert all(s.size > 0 and s.size % align == 0 for s in shards)
    assert len(shards) == len(weights)  # shards[r] is rank r's


def test_rank_with_no_work_fails_closed():
    with pytest.raises(DegeneratePlanError, match=r"rank\(s\) \[1\]"):
        split_by_weights(2, (10, 1))
    with pytest.raises(DegeneratePlanError):
        split_by_weights(2, (1, 1, 1))


def test_unalignable_dimension_fails_closed():
    with pytest.raises(DegeneratePlanError):
        split_by_weights(10, (1, 1), 4)


@pytest.mark.parametrize("text", ["2,x", "1,,1", "2", "1,0", "1,-1", "nan,1", "inf,1"])
def test_unparsable_weights_fail_closed(text):
    with pytest.raises(WeightsParseError):
        parse_weights(text, 2)


def test_weights_parse():
    assert parse_weights("2,1", 2) == (2.0, 1.0)
    assert parse_weights(" 1.5 , 1 ", 2) == (1.5, 1.0)
    assert parse_weights(None, 3) == (1.0, 1.0, 1.0)
    assert parse_weights("", 1) == (1.0,)


def test_choose_align_prefers_large_blocks_with_one_block_per_rank():
    assert choose_align(3072, 2) == 64
    assert choose_align(128, 3) == 32
    assert choose_align(96, 2) == 32
    assert choose_align(151936, 3) == 64
    assert choose_align(37, 2) == 1


def test_qwen3_06b_plan_at_tp2_exact():
    plan = make_tp_plan(
        world_size=2,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
    )
    assert plan.kv_heads == (Span(0, 4), Span(4, 8))
    assert plan.q_heads(1) == Span(8, 16)
    assert plan.q_rows(0) == Span(0, 1024)
    assert plan.kv_rows(1) == Span(512, 1024)
    assert plan.intermediate == (Span(0, 1536), Span(1536, 3072))
    assert plan.vocab == (Span(0, 75968), Span(75968, 151936))


def test_uneven_tp3_plan_exact():
    plan = make_tp_plan(
        world_size=3, n_heads=8, n_kv_heads=4, head_dim=16, intermediate_size=128, vocab_size=256
    )
    assert plan.kv_heads == (Span(0, 2), Span(2, 3), Span(3, 4))
    assert plan.q_heads(0) == Span(0, 4)
    assert plan.q_rows(2) == Span(96, 128)
    assert plan.mlp_align == 32
    assert plan.intermediate == (Span(0, 64), Span(64, 96), Span(96, 128))
    assert plan.vocab == (Span(0, 128), Span(128, 192), Span(192, 256))


def test_weighted_2_to_1_plan_exact():
    plan = make_tp_plan(
        world_size=2,
        n_heads=8,
        n_kv_heads=4,
        head_dim=16,
        intermediate_size=192,
        vocab_size=300,
        weights=(2, 1),
    )
    assert plan.kv_heads == (Span(0, 3), Span(3, 4))
    assert plan.intermediate == (Span(0, 128), Span(128, 192))
    assert plan.vocab_align == 4
    assert plan.vocab == (Span(0, 200), Span(200, 300))


def test_more_ranks_than_kv_heads_replicates_kv_heads():
    plan = make_tp_plan(
        world_size=3, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=64
    )
    assert plan.replicates_kv
    assert plan.kv_heads == (Span(0, 1), Span(0, 1), Span(1, 2))
    assert plan.q_head_shards == (Span(0, 1), Span(1, 2), Span(2, 4))
    plan = make_tp_plan(
        world_size=2,
        n_heads=4,
        n_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=64,
        weights=(2, 1),
    )
    assert plan.kv_heads == (Span(0, 1), Span(0, 1))
    assert plan.q_head_shards == (Span(0, 3), Span(3, 4))
    assert plan.kv_rows(1) == Span(0, 16) and plan.q_rows(1) == Span(48, 64)


def test_more_ranks_than_heads_fails_closed():
    with pytest.raises(DegeneratePlanError, match="attention heads"):
        make_tp_plan(
            world_size=5, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=64
        )


def test_heads_not_a_multiple_of_kv_heads_fails_closed():
    with pytest.raises(TPPlanError):
        make_tp_plan(
            world_size=1, n_heads=6, n_kv_heads=4, head_dim=16, intermediate_size=64, vocab_size=64
        )
