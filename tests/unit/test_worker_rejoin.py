"""`tandem worker --rejoin`'s supervisor: a child that keeps failing at start is started again
after a doubling, capped backoff (no crash loop); one that lived resets it. Real child processes
(a one-line Python command standing in for the worker)."""

import sys

from tandem.cli import worker_rejoin as wr


def test_the_backoff_doubles_for_children_that_fail_at_start_and_resets_after_one_that_lived():
    d = 0.0
    delays = []
    for _ in range(8):
        d = wr.next_delay(0.5, d)
        delays.append(d)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert wr.next_delay(wr.MIN_UP_S, 30.0) == 0.0


def test_a_child_that_exits_at_once_is_started_again_with_backoff_and_its_code_kept(
    monkeypatch, capsys
):
    monkeypatch.setattr(wr, "BACKOFF_START_S", 0.05)
    code = wr.supervise([sys.executable, "-c", "raise SystemExit(3)"], max_starts=3)
    assert code == 3
    said = capsys.readouterr().err.splitlines()
    assert sum("exited with code 3" in line for line in said) == 3
    assert [line.split(" in ")[-1] for line in said if "again in" in line] == ["0.05 s", "0.1 s"]
