import itertools
import random
from types import SimpleNamespace

import pytest

from tandem.parallel.partition import (
    CapacityError,
    EmptyStageError,
    InvalidWeightsError,
    LayerCoverageError,
    LayerRange,
    ModelCost,
    StageCapacity,
    model_cost,
    parse_pp_weights,
    parse_ranges,
    partition_layers,
    split_by_weights,
    validate_ranges,
)

R = LayerRange


def cost(layers: int, head: int = 0, layer_params: int = 100, head_mem: int = 0) -> ModelCost:
    return ModelCost(layers, layer_params, head, head_mem)


QWEN3_06B = SimpleNamespace(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    num_hidden_layers=28,
    tie_word_embeddings=True,
    qk_norm=True,
)


def test_equal_stages_without_head_cost_split_evenly():
    assert partition_layers([StageCapacity()] * 2, cost(4)) == (R(0, 2), R(2, 4))


def test_uneven_remainder_goes_to_lower_stages():
    assert partition_layers([StageCapacity()] * 3, cost(7)) == (R(0, 3), R(3, 5), R(5, 7))


def test_faster_stage_gets_proportionally_more_layers():
    stages = [StageCapacity(speed=2.0), StageCapacity(speed=1.0)]
    assert partition_layers(stages, cost(6)) == (R(0, 4), R(4, 6))


def test_head_lm_head_cost_moves_layers_off_the_head_on_qwen3_shape():
    c = model_cost(QWEN3_06B)
    assert c.layer_params == 15_730_944
    assert c.head_compute_params == 151936 * 1024 + 1024
    assert c.head_memory_params == 151936 * 1024 + 1024  # tied: one matrix
    # The LM head reads ~9.9 layers' worth per token, so equal nodes split 9 + 19, not 14 + 14.
    assert partition_layers([StageCapacity()] * 2, c) == (R(0, 9), R(9, 28))


def test_untied_head_holds_two_vocab_matrices():
    c = model_cost(SimpleNamespace(**{**vars(QWEN3_06B), "tie_word_embeddings": False}))
    assert c.head_memory_params == 2 * 151936 * 1024 + 1024


def test_memory_cap_pushes_layers_to_the_stage_that_has_room():
    stages = [StageCapacity(), StageCapacity(memory_bytes=2 * 100 * 4)]
    assert partition_layers(stages, cost(6)) == (R(0, 4), R(4, 6))


def test_head_memory_counts_embedding_and_lm_head():
    # stage 0: 1000 bytes minus 600 for the head matrices leaves room for one 100-param f32 layer.
    stages = [StageCapacity(memory_bytes=1000), StageCapacity()]
    assert partition_layers(stages, cost(5, head_mem=150)) == (R(0, 1), R(1, 5))


def test_bytes_per_param_follows_the_stage_dtype():
    # 800 bytes hold two f32 layers or four 16-bit layers.
    f32 = [StageCapacity(), StageCapacity(memory_bytes=800, bytes_per_param=4)]
    f16 = [StageCapacity(), StageCapacity(memory_bytes=800, bytes_per_param=2)]
    assert partition_layers(f32, cost(8, head=1000)) == (R(0, 6), R(6, 8))
    assert partition_layers(f16, cost(8, head=1000)) == (R(0, 4), R(4, 8))


def test_too_little_memory_fails_closed():
    with pytest.raises(CapacityError, match="holds 4 of 6"):
        partition_layers([StageCapacity(memory_bytes=800)] * 2, cost(6))
    with pytest.raises(CapacityError, match="not enough for one layer"):
        partition_layers([StageCapacity(memory_bytes=100), StageCapacity()], cost(6))


def test_pp_weights_override_splits_by_largest_remainder():
    assert split_by_weights(28, (2.0, 1.0)) == (R(0, 19), R(19, 28))
    assert split_by_weights(10, (1, 1, 1)) == (R(0, 4), R(4, 7), R(7, 10))
    stages = [StageCapacity()] * 2
    assert partition_layers(stages, model_cost(QWEN3_06B), weights=(1, 1)) == (R(0, 14), R(14, 28))


def test_pp_weights_override_still_respects_memory():
    with pytest.raises(CapacityError, match="stage 1 is given 3 layers"):
        partition_layers(
            [StageCapacity(), StageCapacity(memory_bytes=800)], cost(6), weights=(1, 1)
        )


def test_more_stages_than_layers_is_an_empty_stage():
    with pytest.raises(EmptyStageError, match="3 stages for 2 layers"):
        partition_layers([StageCapacity()] * 3, cost(2))
    with pytest.raises(EmptyStageError):
        partition_layers([], cost(2))


def test_weight_that_rounds_to_zero_layers_fails_closed():
    with pytest.raises(EmptyStageError, match="stage 1 gets no layer"):
        split_by_weights(4, (100.0, 1.0))


@pytest.mark.parametrize("text", ["2,x", "", "1,,2"])
def test_unparseable_weights_fail_closed(text):
    with pytest.raises(InvalidWeightsError, match="not a comma-separated list"):
        parse_pp_weights(text, 2)


@pytest.mark.parametrize("text", ["1,0", "1,-2", "1,inf", "1,nan"])
def test_non_positive_weights_fail_closed(text):
    with pytest.raises(InvalidWeightsError, match="positive and finite"):
        parse_pp_weights(text, 2)


def test_weight_count_must_match_stage_count():
    with pytest.raises(InvalidWeightsError, match="3 weights for 2 stages"):
        parse_pp_weights("1,2,3", 2)
    assert parse_pp_weights("3, 1.5", 2) == (3.0, 1.5)


def test_non_positive_speed_fails_closed():
    with pytest.raises(InvalidWeightsError):
        partition_layers([StageCapacity(speed=0.0), StageCapacity()], cost(4))


@pytest.mark.parametrize(
    "ranges, err, msg",
    [
        ([R(0, 2), R(3, 4)], LayerCoverageError, "skips"),
        ([R(0, 3), R(2, 4)], LayerCoverageError, "repeats"),
        ([R(0, 2), R(2, 5)], LayerCoverageError, "model has 4 layers"),
        ([R(0, 2), R(2, 3)], LayerCoverageError, "cover \\[0, 3\\)"),
        ([R(0, 2), R(2, 2), R(2, 4)], EmptyStageError, "empty range"),
        ([R(1, 4)], LayerCoverageError, "skips"),
        ([], EmptyStageError, "at least one stage"),
    ],
)
def test_validate_ranges_rejects_gaps_overlaps_and_empty_stages(ranges, err, msg):
    with pytest.raises(err, match=msg):
        validate_ranges(ranges, 4)


def test_parse_explicit_ranges():
    assert parse_ranges("0:3,3:4", 4) == (R(0, 3), R(3, 4))
    with pytest.raises(LayerCoverageError, match="START:END"):
        parse_ranges("0-3,3:4", 4)


def test_layer_range_is_half_open():
    assert list(R(2, 5)) == [2, 3, 4] and len(R(2, 5)) == 3 and str(R(2, 5)) == "[2, 5)"


def _brute_force_makespan(stages, c):
    best = None
    n = len(stages)
    for cut in itertools.combinations(range(1, c.num_layers), n - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, c.num_layers))]
        t = max(
            (k * c.layer_params + (c.head_compute_params if i == 0 else 0)) / stages[i].speed
            for i, k in enumerate(counts)
        )
        best = t if best is None else min(best, t)
    return best


def test_partition_covers_every_layer_once_and_is_optimal_on_random_fleets():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 4)
        c = cost(rng.randint(n, 12), head=rng.choice([0, 50, 250, 1000]))
        stages = [StageCapacity(speed=rng.choice([0.5, 1.0, 1.5, 3.0])) for _ in range(n)]
        ranges = partition_layers(stages, c)
        assert validate_ranges(ranges, c.num_layers) == ranges
        t = max(
            (len(r) * c.layer_params + (c.head_compute_params if i == 0 else 0)) / stages[i].speed
            for i, r in enumerate(ranges)
        )
        assert t == pytest.approx(_brute_force_makespan(stages, c))
