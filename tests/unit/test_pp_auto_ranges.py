"""`--pp-weights auto`'s split (`tandem.engine.pp.layout.auto_ranges`): a stage's speed is its
slowest rank's probed GEMV GB/s times its TP degree over its dtype's bytes per parameter, its memory its smallest rank's free GB times
the degree; layers go where they finish first (`partition_layers`), and a plan that does not fit is
refused before anything loads."""

from types import SimpleNamespace

import pytest

from tandem.engine.device_probe import measure_local
from tandem.engine.pp.layout import (
    LayoutError,
    StageProbe,
    StageSpec,
    auto_ranges,
    describe_auto,
    plan_stages,
    ranks_differ,
)
from tandem.parallel.partition import CapacityError
from tandem.parallel.partition import LayerRange as R

# 8 layers of 4 * 64 * 64 + 3 * 64 * 128 + 128 = 41,088 params; LM head 1000 * 64
CONFIG = SimpleNamespace(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=128,
    vocab_size=1000,
    num_hidden_layers=8,
    tie_word_embeddings=True,
)
TWO = [StageSpec(R(0, 4)), StageSpec(R(4, 8))]


def ranges(stages):
    return [s.layers for s in stages]


def test_the_faster_stage_gets_more_layers_and_the_head_pays_for_its_lm_head():
    even = [StageProbe((10.0,), (64.0,)), StageProbe((10.0,), (64.0,))]
    assert ranges(auto_ranges(CONFIG, TWO, even)) == [R(0, 3), R(3, 8)]  # LM head ~1.6 layers
    fast_tail = [StageProbe((10.0,), (64.0,)), StageProbe((30.0,), (64.0,))]
    assert ranges(auto_ranges(CONFIG, TWO, fast_tail)) == [R(0, 1), R(1, 8)]


def test_a_tp_stage_runs_at_its_slowest_rank_times_its_degree():
    cap = StageProbe((10.0, 4.0), (8.0, 2.0)).capacity(2)
    assert cap.speed == 4.0 and cap.memory_bytes == 4_000_000_000 and cap.bytes_per_param == 2


def test_stages_of_different_dtypes_compare_by_parameters_per_second():
    # the same GB/s: the bfloat16 stage reads half the bytes per layer, so it is twice as fast
    mixed = [StageSpec(R(0, 4)), StageSpec(R(4, 8), dtype="bfloat16")]
    same = [StageProbe((10.0,), (64.0,)), StageProbe((10.0,), (64.0,))]
    assert ranges(auto_ranges(CONFIG, mixed, same)) == [R(0, 1), R(1, 8)]  # by GB/s: 0:3, 3:8


def test_a_stage_without_memory_for_its_layers_is_refused_before_loading():
    tiny = [StageProbe((10.0,), (64.0,)), StageProbe((10.0,), (1e-6,))]  # 1 kB
    with pytest.raises(CapacityError, match="stage 1"):
        auto_ranges(CONFIG, TWO, tiny)


def test_the_local_probe_reports_positive_figures_and_the_notice_names_each_stage():
    gemv, free = measure_local("cpu", "float32")
    assert gemv > 0 and free > 0
    probes = [{"gemv_gb_s": [gemv], "free_gb": [free]}] * 2
    line = describe_auto(TWO, probes)
    assert "stage 0 layers 0:4" in line and "stage 1 layers 4:8" in line


def test_dtype_takes_one_value_per_rank_of_the_grid_in_rank_order():
    per_rank = plan_stages(CONFIG, (2, 1), dtype="bfloat16,float16,float32")
    assert [(s.dtype, s.rank_dtypes) for s in per_rank] == [
        ("bfloat16", ("bfloat16", "float16")),
        ("float32", ()),
    ]
    assert [s.dtype_of(r) for s in per_rank for r in range(s.tp)] == [
        "bfloat16",
        "float16",
        "float32",
    ]
    per_stage = plan_stages(CONFIG, (2, 1), dtype="bfloat16,float16")
    assert [s.dtype_of(r) for s in per_stage for r in range(s.tp)] == [
        "bfloat16",
        "bfloat16",
        "float16",
    ]
    with pytest.raises(LayoutError, match="one per rank \\(3\\)"):
        plan_stages(CONFIG, (2, 1), dtype="bfloat16,float16,float16,float16")
    with pytest.raises(LayoutError, match="one per TP rank"):
        StageSpec(R(0, 4), tp=2, dtype="float16", rank_dtypes=("bfloat16", "float16"))


def test_a_tp_stage_of_mixed_dtypes_is_sized_by_its_widest_dtype():
    mixed = StageSpec(R(0, 4), tp=2, dtype="bfloat16", rank_dtypes=("bfloat16", "float32"))
    assert mixed.widest_bytes == 4
    assert StageSpec(R(0, 4), tp=2, dtype="bfloat16").widest_bytes == 2


def test_auto_is_the_default_only_where_the_stages_ranks_differ():
    assert ranks_differ(plan_stages(CONFIG, (2, 1))) is None  # alike ranks: split by TP degree
    mixed = plan_stages(CONFIG, (1, 1), dtype="float32,bfloat16")
    assert ranks_differ(mixed) == "the ranks differ in dtype float32/bfloat16"
    in_stage = plan_stages(CONFIG, (2, 1), dtype="bfloat16,float16,bfloat16")
    assert ranks_differ(in_stage) == "the ranks differ in dtype bfloat16/float16"
    devices = plan_stages(CONFIG, (1, 1), device="cpu,cuda")
    assert ranks_differ(devices) == "the ranks differ in device cpu/cuda"
