"""The supervised process group: whole trees go down together, even stubborn or orphaned ones."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from tandem.cluster.launcher import ProcessGroup, RankProcess

# a rank that starts a grandchild and then sleeps (optionally ignoring SIGINT and SIGTERM)
RANK = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
    """
)


def _wait_for_tree(group: ProcessGroup, n: int, timeout_s: float = 20.0) -> list[int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        pids = group.pids()
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"expected {n} processes, got {group.pids()}")


def _gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_shutdown_takes_down_every_rank_and_its_children_even_stubborn_ones():
    ranks = [
        RankProcess("polite", [sys.executable, "-c", RANK, "polite"]),
        RankProcess("stubborn", [sys.executable, "-c", RANK, "stubborn"]),
    ]
    group = ProcessGroup(ranks, grace_s=0.5)
    group.start()
    try:
        pids = _wait_for_tree(group, 4)
        assert group.poll() is None
    finally:
        group.shutdown()
    assert _gone(pids)


def test_a_stopped_rank_is_not_waited_for_and_is_continued_to_take_its_sigint(tmp_path):
    """A hung rank (SIGSTOPped) never leaves on its own: shutdown does not wait `wait_s` for it,
    and continues it with its SIGINT, so its handler runs (a SIGKILL would leave no trace)."""
    mark = tmp_path / "took-sigint"
    code = textwrap.dedent(
        f"""
        import pathlib, signal, sys, time
        def on_int(*_):
            pathlib.Path({str(mark)!r}).write_text("yes")
            sys.exit(0)
        signal.signal(signal.SIGINT, on_int)
        pathlib.Path({str(mark)!r} + ".ready").write_text("")
        time.sleep(600)
        """
    )
    group = ProcessGroup([RankProcess("hung", [sys.executable, "-c", code])], grace_s=5.0)
    group.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "took-sigint.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    group.procs[0].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    group.shutdown(wait_s=120.0)
    assert time.monotonic() - t0 < 60.0  # not the 120 s a live rank would be given
    assert mark.read_text() == "yes"


def test_poll_reports_the_first_rank_that_exits():
    ranks = [
        RankProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"]),
        RankProcess("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"]),
    ]
    with ProcessGroup(ranks) as group:
        assert group.wait(interval_s=0.05) == ("crasher", 3)
        sleeper = group.procs[0].pid
    assert _gone([sleeper])


def test_ranks_die_with_a_launcher_that_is_killed_outright():
    launcher = textwrap.dedent(
        """
        import sys, time
        from tandem.cluster.launcher import ProcessGroup, RankProcess
        g = ProcessGroup([RankProcess("r", [sys.executable, "-c", "import time; time.sleep(600)"])])
        g.start()
        print(g.procs[0].pid, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        rank_pid = int(proc.stdout.readline())
        assert psutil.pid_exists(rank_pid)
        os.kill(proc.pid, signal.SIGKILL)  # no handler, no finally: only the parent-death signal
        proc.wait(10)
        assert _gone([rank_pid])
    finally:
        proc.kill()
        proc.wait(10)


def test_diagnose_names_every_exited_rank_with_its_code_and_the_tail_of_its_log(tmp_path):
    ranks = [
        RankProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"]),
        RankProcess("crasher", [sys.executable, "-c", "print('one'); print('two'); exit(3)"]),
    ]
    with ProcessGroup(ranks, log_dir=tmp_path) as group:
        assert group.diagnose(wait_s=20.0, lines=1) == "crasher exited with code 3: two"
        assert group.poll() == ("crasher", 3)


def test_a_piped_rank_answers_on_stdout_and_its_stderr_goes_to_its_log(tmp_path):
    echo = (
        "import sys; print(sys.stdin.readline().upper(), end='', flush=True); sys.stderr.write('e')"
    )
    with ProcessGroup(
        [RankProcess("stage 1", [sys.executable, "-c", echo], pipes=True)], tmp_path
    ) as g:
        (p,) = g.procs
        p.stdin.write(b"ports\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"PORTS\n"
        assert p.wait(20) == 0
        assert g.log_path("stage 1").read_text() == "e"
        assert g.rank_pids() == {"stage 1": p.pid}


def test_end_brings_down_one_rank_and_a_rank_spawned_later_joins_the_shutdown():
    group = ProcessGroup(grace_s=0.5)
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    try:
        first = group.spawn(RankProcess("first", sleep))
        second = group.spawn(RankProcess("second", sleep), stdout=subprocess.PIPE)
        group.end(first)
        assert first.poll() is not None and second.poll() is None
    finally:
        group.shutdown()
    assert second.poll() is not None
