"""Pipelines of real processes on loopback match the single-node reference: PP=2, PP=3 with uneven
stages, a 2x2 grid and a (TP=2, TP=1) grid; and a stage killed mid-generation is reported at the
head within the timeout."""

import os
import signal
import time

import pytest
import torch
from pp_support import (
    executor_greedy,
    mixed_reference_greedy,
    prompts,
    reference_greedy,
    reference_model,
    tiny_config,
    write_model,
)
from tp_support import SingleNode, assert_same_logits, run_rewind_script

from tandem.engine.executor import Step, StepSequence
from tandem.engine.pp.head import PipelineFailedError
from tandem.engine.pp.launch import StageSpec, launch_pipeline
from tandem.parallel.partition import LayerRange as R

N_NEW = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    ref = reference_model(tiny_config(num_hidden_layers=5, vocab_size=97))
    return ref, write_model(ref, tmp_path_factory.mktemp("pp") / "tiny")


@pytest.fixture(scope="module")
def references(model_dir):
    ref, _ = model_dir
    return {b: reference_greedy(ref, prompts(b, 97), N_NEW) for b in (1, 3)}


LAYOUTS = {
    "pp2": [StageSpec(R(0, 2)), StageSpec(R(2, 5))],
    "pp3-uneven": [StageSpec(R(0, 1)), StageSpec(R(1, 4)), StageSpec(R(4, 5))],
    "grid-2x2": [StageSpec(R(0, 3), tp=2), StageSpec(R(3, 5), tp=2)],
    "grid-tp2-tp1": [StageSpec(R(0, 2), tp=2), StageSpec(R(2, 5), tp=1)],
}


@pytest.fixture(scope="module")
def rewind_reference(model_dir):
    return run_rewind_script(SingleNode(model_dir[1]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_processes_match_single_node_at_batch_1_and_3(
    model_dir, references, rewind_reference, layout
):
    _, path = model_dir
    ex = launch_pipeline(path, LAYOUTS[layout], max_batch=4, max_seq_len=64, timeout=30, threads=1)
    try:
        for b, base in ((1, 0), (3, 10)):
            first, ids = executor_greedy(ex, prompts(b, 97), N_NEW, base_id=base)
            ref_first, ref_ids = references[b]
            torch.testing.assert_close(first, ref_first, atol=1e-4, rtol=0)
            assert ids == ref_ids, f"batch {b}"
        # a rewind (start_pos behind the cached length) re-prefills on every stage and rank
        assert_same_logits(run_rewind_script(ex), rewind_reference)
    finally:
        ex.close()


@pytest.mark.parametrize(
    "stages, victim, expect",
    [
        ([StageSpec(R(0, 2)), StageSpec(R(2, 5))], "stage 1 rank 0", "stage 1 rank 0 exited"),
        (
            [StageSpec(R(0, 1)), StageSpec(R(1, 3)), StageSpec(R(3, 5))],
            "stage 1 rank 0",
            "stage 2 lost its upstream link",
        ),
    ],
)
def test_a_stage_killed_mid_generation_is_a_clear_error_at_the_head_within_the_timeout(
    model_dir, stages, victim, expect
):
    _, path = model_dir
    timeout = 5.0
    ex = launch_pipeline(path, stages, max_batch=4, max_seq_len=64, timeout=timeout, threads=1)
    try:
        logits = ex.run(Step((StepSequence(0, (1, 2, 3), 0),))).logits
        for pos in range(3, 6):
            logits = ex.run(Step((StepSequence(0, (int(logits.argmax()),), pos),))).logits
        os.kill(ex.worker_pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PipelineFailedError, match=expect):
            for pos in range(6, 40):
                logits = ex.run(Step((StepSequence(0, (int(logits.argmax()),), pos),))).logits
        assert time.monotonic() - t0 < timeout + 5
    finally:
        t0 = time.monotonic()
        ex.close()
        assert time.monotonic() - t0 < 20
    assert all(p.poll() is not None for p in ex.worker_procs)


def test_stages_in_different_dtypes_meet_at_the_float32_wire(model_dir):
    """Stage 1 computes in bfloat16, the head in float32: the seam converts explicitly both ways,
    so the run equals the same mixed computation in one process."""
    ref, path = model_dir
    stages = [StageSpec(R(0, 2)), StageSpec(R(2, 5), dtype="bfloat16")]
    ps = prompts(3, 97)
    want_first, want_ids = mixed_reference_greedy(ref, 2, torch.bfloat16, ps, 8)
    ex = launch_pipeline(path, stages, max_batch=4, max_seq_len=64, timeout=30, threads=1)
    try:
        first, ids = executor_greedy(ex, ps, 8)
    finally:
        ex.close()
    torch.testing.assert_close(first, want_first, atol=3e-2, rtol=0)
    assert ids == want_ids
