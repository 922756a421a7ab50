"""`tandem launch --tp 3 --shrink-after S`: a worker is SIGKILLed in the middle of 4 streaming greedy
requests and never comes back (every process started again in its place is killed at once), so
after S seconds the group re-forms as TP=2 over the survivors' places and replays: every stream
completes with the text of the uninterrupted TP=3 run (a layout change does not change greedy
output on the reference model in f32). The same for `--pp 2`, whose stage never returns: the head
serves alone. Real processes on loopback."""

import contextlib
import threading
import time

import psutil
import pytest
from serve_support import make_model, metric, running

from tandem.bench.fault_drill import health, run_drill, worker_pids

PROMPTS = ["Once upon a time", "The cat", "In a galaxy far away", "Hello"]
MAX_TOKENS = 32
# a PP=2 pipeline of the tiny preset streams 32 tokens in ~0.1 s on a quiet machine, faster than
# the drill sees every stream's 4th chunk: long enough streams that the fault lands mid-stream
PP_MAX_TOKENS = 256
SHRINK_AFTER_S = 5


def _server_pid(proc) -> int:
    for c in psutil.Process(proc.pid).children():
        if "serve" in c.cmdline():
            return c.pid
    raise AssertionError("no `tandem serve` below `tandem launch`")


def _rank_of_3(pid: int) -> str | None:
    """The `--rank` of a worker of a 3-rank group, else None."""
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    if "--world-size" not in argv or argv[argv.index("--world-size") + 1] != "3":
        return None
    return argv[argv.index("--rank") + 1]


class _NeverBack(threading.Thread):
    """SIGKILLs every new process below `server` that starts as rank `rank` of 3 (None: every
    new worker or stage process)."""

    def __init__(self, server: int, rank: str | None, first: set[int]) -> None:
        super().__init__(daemon=True)
        self.server, self.rank, self.first = server, rank, first
        self.killed, self.halt = 0, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            for pid in worker_pids(self.server):
                if pid not in self.first and (self.rank is None or _rank_of_3(pid) == self.rank):
                    with contextlib.suppress(psutil.Error):
                        psutil.Process(pid).kill()
                        self.killed += 1


# ~90 s on 2 shared cores: a TP=3 launch (4 processes), its quiet run, a failed TP=3 re-form and a
# TP=2 one, each starting processes that load the model
@pytest.mark.slow
def test_a_tp3_group_whose_lost_rank_never_returns_shrinks_to_tp2_and_every_stream_completes(
    tmp_path,
):
    model = make_model(tmp_path / "model")
    args = ["launch", "--model", str(model), "--tp", "3", "--no-demo", "--max-batch", "4"]
    args += ["--reform-timeout", "120", "--op-timeout", "5"]
    with running([*args, "--shrink-after", str(SHRINK_AFTER_S)]) as (proc, base):
        server = _server_pid(proc)
        quiet = run_drill(base, server, PROMPTS, max_tokens=MAX_TOKENS, sig=None)
        assert [s.error for s in quiet.streams] == [None] * 4
        first = worker_pids(server)  # run_drill's victim is the first of these
        reaper = _NeverBack(server, _rank_of_3(first[0]), set(first))
        reaper.start()
        t0 = time.monotonic()
        res = run_drill(base, server, PROMPTS, max_tokens=MAX_TOKENS, timeout_s=240)
        reaper.halt.set()
        assert res.victim_pid == first[0] and res.in_flight_at_fault == 4
        assert [s.error for s in res.streams] == [None] * 4
        assert [s.text for s in res.streams] == [s.text for s in quiet.streams]
        assert health(base)[0] == 200 and proc.poll() is None
        assert metric(base, "tandem_group_shrinks_total") == 1
        assert len(worker_pids(server)) == 1  # TP=2: the head and one worker
        print(
            f"shrunk to TP=2: /health 503 at {res.detect_s} s, 200 at {res.whole_s} s, every "
            f"stream done at {res.done_s} s after the fault ({time.monotonic() - t0:.1f} s drill); "
            f"the lost rank was killed {reaper.killed} more time(s) as it tried to come back"
        )


# ~50 s on 2 shared cores: a PP=2 launch, its quiet run, a failed PP=2 re-form and the head
# loading the whole model alone
@pytest.mark.slow
def test_a_pp2_pipeline_whose_stage_never_returns_shrinks_to_the_head_alone_with_equal_texts(
    tmp_path,
):
    model = make_model(tmp_path / "model")
    args = ["launch", "--model", str(model), "--tp", "1", "--pp", "2", "--no-demo"]
    args += ["--max-batch", "4", "--reform-timeout", "120", "--op-timeout", "5"]
    with running([*args, "--shrink-after", str(SHRINK_AFTER_S)]) as (proc, base):
        server = _server_pid(proc)
        quiet = run_drill(base, server, PROMPTS, max_tokens=PP_MAX_TOKENS, sig=None)
        assert [s.error for s in quiet.streams] == [None] * 4
        first = worker_pids(server)
        reaper = _NeverBack(server, None, set(first))
        reaper.start()
        res = run_drill(base, server, PROMPTS, max_tokens=PP_MAX_TOKENS, timeout_s=240)
        reaper.halt.set()
        assert res.victim_pid == first[0] and res.in_flight_at_fault == 4
        assert [s.error for s in res.streams] == [None] * 4, res.health[-3:]
        assert [s.text for s in res.streams] == [s.text for s in quiet.streams]
        assert health(base)[0] == 200 and proc.poll() is None
        assert metric(base, "tandem_group_shrinks_total") == 1
        assert worker_pids(server) == []  # the head alone: no stage process
