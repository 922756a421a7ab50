"""Heterogeneous ranks across processes: rank 0 computes in bfloat16, rank 1 in float16 (as an AMD
and an NVIDIA box might), and the group still follows single-node bfloat16's greedy ids; the same
for a pipeline whose stage 0 computes in bfloat16 and stage 1 in float16, and for a (TP=2, TP=1)
grid whose TP stage has a bfloat16 rank and a float16 rank. The comparison (up to the first
float32 near-tie) is `mixed_dtype_support`'s. Across processes: a dense preset with a sliding
window (the first) and the hybrid MoE (the last); every tiny preset and a real-size qwen3-0.6b
run the same group setup on in-process ranks (tests/unit/test_tp_mixed_dtype_in_process.py)."""

import re

import pytest
from mixed_dtype_support import compare_to_single_node_bf16, covered_prefix
from tp_support import close_concurrently, launch_concurrently

from tandem.engine.pp.launch import launch_pipeline
from tandem.engine.pp.layout import StageSpec, plan_stages
from tandem.loaders.make import make_model_dir
from tandem.loaders.source import open_model
from tandem.models.presets import PRESETS
from tandem.parallel.partition import LayerRange

TINY = sorted(p for p in PRESETS if p.startswith("tiny-"))
ACROSS_PROCESSES = [TINY[0], TINY[-1]]
_compare = compare_to_single_node_bf16


@pytest.fixture(scope="module")
def tiny_groups(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    dirs = {}
    for preset in ACROSS_PROCESSES:
        dirs[preset] = root / preset
        make_model_dir(dirs[preset], preset, seed=0)
    groups = launch_concurrently(
        {p: (d, 2, {}) for p, d in dirs.items()},
        dtypes=["bfloat16", "float16"],
        max_batch=1,
        max_seq_len=64,
        threads=1,
    )
    try:
        yield {p: (dirs[p], groups[p]) for p in ACROSS_PROCESSES}
    finally:
        close_concurrently(groups.values())


@pytest.mark.parametrize("preset", ACROSS_PROCESSES)
def test_bf16_and_f16_ranks_follow_single_node_bf16_on_tiny_presets(
    tiny_groups, record_property, preset
):
    model_dir, ex = tiny_groups[preset]
    _compare(model_dir, ex, record_property)


def test_a_bf16_stage_and_an_f16_stage_follow_single_node_bf16(tiny_groups, record_property):
    model_dir, _ = tiny_groups[TINY[-1]]
    n = open_model(model_dir).config.num_hidden_layers
    stages = [
        StageSpec(LayerRange(0, n // 2), dtype="bfloat16"),
        StageSpec(LayerRange(n // 2, n), dtype="float16"),
    ]
    ex = launch_pipeline(model_dir, stages, max_batch=1, max_seq_len=64, threads=1)
    try:
        _compare(model_dir, ex, record_property)
    finally:
        ex.close()


def test_a_tp_stage_with_a_bf16_and_an_f16_rank_follows_single_node_bf16(
    tiny_groups, record_property
):
    """A (TP=2, TP=1) grid: stage 0's ranks compute in bfloat16 (the head) and float16, stage 1 in
    float16; the stage ring and the stage links carry float32."""
    model_dir, _ = tiny_groups[TINY[-1]]
    cfg = open_model(model_dir).config
    stages = plan_stages(cfg, (2, 1), dtype="bfloat16,float16,float16")
    assert [s.dtype_of(r) for s in stages for r in range(s.tp)] == [
        "bfloat16",
        "float16",
        "float16",
    ]
    ex = launch_pipeline(model_dir, stages, max_batch=1, max_seq_len=64, threads=1)
    try:
        # each worker process was told its own rank's dtype (global ranks 1 and 2)
        started = [p.args[p.args.index("--dtype") + 1] for p in ex.worker_procs]
        assert started == ["float16", "float16"]
        _compare(model_dir, ex, record_property, dtypes=("bfloat16", "float16", "float16"))
    finally:
        ex.close()


def test_covered_prefix_stops_at_the_first_near_tie():
    assert covered_prefix([3.0, 2.0, 0.4, 5.0], 0.5) == 2
    assert covered_prefix([3.0, 2.0], 0.5) == 2


def test_a_bf16_and_f16_group_given_no_weights_is_split_by_its_probe(tiny_groups):
    _, ex = tiny_groups[TINY[0]]
    assert ex.placement.startswith("TP weights ")
    assert "(auto: the ranks differ in dtype bfloat16/float16" in ex.placement
    state, detail = ex.health()
    assert state and ex.placement in detail  # what /health and `cluster status` show
    probed = [r["probe"]["gemv_gb_s"] for r in ex.describe()["ranks"]]  # rounded to 1e-3
    # proportional to the probed speeds, or tempered where the tiny model's 2 kv heads cannot
    # split that unevenly (`tp.setup.plannable`)
    power = re.search(r"tempered to the power ([0-9.]+)", ex.placement)
    a = float(power.group(1)) if power else 1.0
    want = [(g / min(probed)) ** a for g in probed]
    # then a short decode at join keeps them or refines them (`engine/tp/refine.py`)
    assert ("decode at join" in ex.placement) and ex.layout.probed == 1
    if "refined by" in ex.placement:
        assert min(ex.layout.weights) == pytest.approx(1.0)
        assert " from " in ex.placement  # and says what it refined
    else:
        assert list(ex.layout.weights) == pytest.approx(want, rel=1e-2)
