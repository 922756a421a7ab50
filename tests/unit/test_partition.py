import itertools
import random
from types import SimpleNamespace

import pytest
from model_shapes import qwen3_30b_a3b

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


# ---- mixture of experts: a token reads its top-k experts, memory holds all of them ----------------


def test_qwen3_30b_a3b_reads_3_3_b_parameters_per_token_of_30_5_b_held():
    """Per layer: attention 2048 128 (32 + 2 4) + 32 128 2048 = 18 874 368, norms 2 2048 + 2 128;
    the router 128 2048 = 262 144; 8 experts read, 8 3 2048 768 = 37 748 736, all 128 held,
    603 979 776. Read per token: 48 56 889 600 + the LM head and final norm 311 166 976 =
    3.04 B, 3.35 B with the embedding matrix (the model card's 3.3 B active); held: 48 623 120 640
    + both vocabulary matrices and the final norm 622 331 904 = 30.53 B."""
    from tandem.parallel.partition import layer_held_params, layer_read_params

    config = qwen3_30b_a3b()
    assert layer_read_params(config, 0) == 18_878_720 + 262_144 + 37_748_736 == 56_889_600
    assert layer_held_params(config, 0) == 18_878_720 + 262_144 + 603_979_776 == 623_120_640
    c = model_cost(config)
    assert c.layer_params == 56_889_600 and c.held_per_layer == 623_120_640
    read = c.num_layers * c.layer_params + c.head_compute_params
    held = c.num_layers * c.held_per_layer + c.head_memory_params
    assert read + 151936 * 2048 == 3_353_032_704  # ~3.3 B active, the embedding counted
    assert held == 30_532_122_624  # ~30.5 B total


def test_qwen3_30b_a3b_stages_are_capped_by_what_they_hold_and_split_by_what_they_read():
    """Two equal bfloat16 stages of 32 GB: a layer holds 623 120 640 2 = 1.246 GB, so stage 0
    (the head, 1.245 GB of vocabulary) holds 24 layers and stage 1 25. Weighed by reads the head
    would take 21 (its LM head reads 5.5 layers' worth), leaving 27 = 33.6 GB for stage 1: more
    than it holds, so stage 1 gets its 25 and the head 23. Weighed by the dense formula (an MLP of
    6144 per layer, 56.6 M held) each stage held over 270 layers and the 21 / 27 split went
    through."""
    c = model_cost(qwen3_30b_a3b())
    unbounded = [StageCapacity(bytes_per_param=2)] * 2
    assert partition_layers(unbounded, c) == (R(0, 21), R(21, 48))
    stages = [StageCapacity(memory_bytes=32 * 10**9, bytes_per_param=2)] * 2
    assert partition_layers(stages, c) == (R(0, 23), R(23, 48))
    with pytest.raises(CapacityError):  # 48 layers do not fit two 28 GB stages (21 + 22)
        partition_layers([StageCapacity(memory_bytes=28 * 10**9, bytes_per_param=2)] * 2, c)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"])
def test_a_moe_layers_held_and_read_params_are_the_reference_layers(preset):
    """Held: every parameter of the reference model's layer (tiny-qwen3-moe's dense layer 1
    among sparse ones included). Read: the same layer with only top-k experts, plus the router's
    rows of the other experts (the router reads its whole matrix)."""
    from dataclasses import replace

    from tandem.models.llama import Transformer
    from tandem.models.presets import PRESETS
    from tandem.parallel.partition import layer_held_params, layer_read_params

    config = PRESETS[preset].config
    spec = config.moe
    top_k_only = replace(config, moe=replace(spec, num_experts=spec.top_k))
    full, top = Transformer(config), Transformer(top_k_only)
    for i in range(config.num_hidden_layers):
        held = sum(p.numel() for p in full.model.layers[str(i)].parameters())
        assert layer_held_params(config, i) == held
        routed = sum(p.numel() for p in top.model.layers[str(i)].parameters())
        unread_router_rows = (spec.num_experts - spec.top_k) * config.hidden_size
        sparse = config.is_sparse(i)
        assert layer_read_params(config, i) == routed + (unread_router_rows if sparse else 0)
    if preset == "tiny-qwen3-moe":
        assert not config.is_sparse(1)  # the dense layer among sparse ones was counted
