"""A pipeline's head sees a hung stage process by its heartbeat (`tandem.engine.pp.beats`), idle or
mid-generation, within 2x the heartbeat timeout and far below the op timeout (60 s here, so the
heartbeat is what saw it): a stage of PP=2, and a TP rank of a grid's stage that has no data link
to the head at all. A long legitimate step (a 4,000-token prefill on one thread per process) is not
taken for a hang. Real `tandem stage` processes on loopback, started by `launch_pipeline` (as
`tandem serve --pp` does) or by `build_serving_engine` with re-form off, so the loss ends the
group. The stage is SIGSTOPped: every socket stays open and silent, as behind a blackholed link."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace

import psutil
import pytest
import torch
from tp_support import engine_generate, stop_mid_generation

from tandem.engine.executor import Step, StepSequence
from tandem.engine.pp.head import PipelineFailedError
from tandem.engine.pp.launch import launch_pipeline
from tandem.engine.pp.layout import plan_stages
from tandem.loaders.make import make_model_dir
from tandem.models.presets import get_preset

OP_TIMEOUT_S = 60.0
HEARTBEAT_S = 2.0
BOUND_S = 2 * HEARTBEAT_S  # timeout + one beat interval + a loaded 2-core machine's slack

# (stages' TP degrees, which worker process is stopped, how the head names it)
LAYOUTS = {
    "pp2-stage1": ((1, 1), 0, "rank 1 is lost", "(stage 1)"),
    "grid-stage1-tp-rank1": ((1, 2), 1, "rank 2 is lost", "(stage 1, TP rank 1)"),
}
# the same through the serving engine (`--tp T --pp P`): (tp, pp, the stopped global rank, and
# how it may be named: by the head's heartbeat, or, in a grid, by the stage's own ring heartbeat
# in the stage's TP ranks, whose ERROR frame can reach the head first)
SERVED = {
    "pp2-stage1": (1, 2, 1, [("rank 1 is lost", "(stage 1)")]),
    "grid2x2-stage1-tp-rank1": (
        2,
        2,
        3,
        [("rank 3 is lost", "(stage 1, TP rank 1)"), ("rank 1 is lost", "stage 1 (TP rank 0)")],
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tmp_path_factory.mktemp("beat-pp") / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    return model


def _pipeline(model, stage_tp, **kw):
    stages = plan_stages(get_preset("tiny-llama").config, stage_tp)
    return launch_pipeline(
        model, stages, timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S, max_seq_len=256, **kw
    )


def _wait_unhealthy(health, limit_s: float) -> tuple[float, str]:
    t0 = time.monotonic()
    while health()[0] and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)
    return time.monotonic() - t0, health()[1]


def _resume_and_kill(proc) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(10)


def _step(seq_id: int, n: int) -> Step:
    return Step((StepSequence(seq_id, tuple(i % 500 + 1 for i in range(n)), 0),))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_hung_stage_of_an_idle_pipeline_is_seen_by_its_heartbeat(tiny, layout) -> None:
    stage_tp, victim, named, where = LAYOUTS[layout]
    ex = _pipeline(tiny, stage_tp)
    proc = ex.worker_procs[victim]
    try:
        ex.run(_step(0, 5))
        time.sleep(2 * HEARTBEAT_S)  # idle past the heartbeat timeout: the beats keep it whole
        assert ex.health()[0], ex.health()
        proc.send_signal(signal.SIGSTOP)
        seen_after, why = _wait_unhealthy(ex.health, OP_TIMEOUT_S)
        assert not ex.health()[0]
        assert seen_after <= BOUND_S < OP_TIMEOUT_S / 10, (seen_after, why)
        assert named in why and "heartbeat" in why and where in why, why
        with pytest.raises(PipelineFailedError, match="heartbeat"):
            ex.run(_step(1, 3))  # the next step fails at once, naming the loss
    finally:
        _resume_and_kill(proc)
        ex.close()


def _stage_processes() -> list[psutil.Process]:
    return [c for c in psutil.Process().children() if "stage" in c.cmdline()]


@pytest.mark.parametrize("layout", sorted(SERVED))
def test_a_stage_hung_mid_generation_fails_the_request_by_its_heartbeat(tiny, layout) -> None:
    from tandem.cli.engine_factory import build_serving_engine

    tp, pp, victim, names = SERVED[layout]
    before = {p.pid for p in _stage_processes()}
    engine, close = build_serving_engine(
        tiny, tp=tp, pp=pp, max_seq_len=256, op_timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S
    )
    (proc,) = [p for p in _stage_processes() if p.pid not in before and _rank_of(p) == victim]
    try:
        assert engine_generate(engine)[1] is None
        why = stop_mid_generation(engine, proc, OP_TIMEOUT_S, BOUND_S)
        assert any(named in why and where in why for named, where in names), why
    finally:
        proc.send_signal(signal.SIGCONT)
        close()


def _rank_of(p: psutil.Process) -> int:
    argv = p.cmdline()
    return int(argv[argv.index("--rank") + 1])


def test_a_long_prefill_is_not_taken_for_a_hang(tmp_path) -> None:
    """A 4,000-token prefill that keeps the head and the stage computing for more than twice the
    heartbeat timeout (one torch thread each; the model sized so that even a fast, quiet core
    takes several times that) leaves the pipeline whole throughout."""
    base = get_preset("tiny-llama").config
    cfg = replace(
        base, hidden_size=384, intermediate_size=1152, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
    )  # fmt: skip
    model = tmp_path / "long"
    make_model_dir(model, "tiny-llama", seed=0, config=cfg, dtype=torch.bfloat16)
    stages = plan_stages(cfg, (1, 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ex = launch_pipeline(
        model, stages, timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S, max_seq_len=4096,
        max_batch=1, threads=1,
    )  # fmt: skip
    unhealthy: list = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            ok, why = ex.health()
            if not ok:
                unhealthy.append(why)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        result = ex.run(_step(0, 4000))
        took = time.monotonic() - t0
        stop.set()
        watcher.join()
        assert took > 2 * HEARTBEAT_S, f"the prefill took {took:.1f} s: too short to prove anything"
        assert result.logits.shape == (1, cfg.vocab_size)
        assert unhealthy == [] and ex.health()[0], (unhealthy, ex.health())
        ex.run(Step((StepSequence(0, (7,), 4000),)))  # and the pipeline decodes on
    finally:
        stop.set()
        torch.set_num_threads(threads)
        ex.close()
