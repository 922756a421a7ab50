"""What a rank's exit code means, for the supervisor's messages; no dependencies (the torch- and
psutil-free single-node path raises `MAPPED_FILE_EXIT` too)."""

from __future__ import annotations

import contextlib
import signal

# a rank that read a page of a mapped model file past its end (the file truncated or replaced
# under it) exits with this code, after a line naming the file (tandem/kernels/csrc/sigbus.c)
MAPPED_FILE_EXIT = 85
# a long-lived rank (worker, stage) whose heartbeat declared a ring neighbour lost (a silent link,
# a hung or stopped peer: `transport.heartbeat.PeerLostError`) exits with this code, so a head that
# sees the exit before its own heartbeat fires still reports a heartbeat loss, not "code 1"
PEER_LOST_EXIT = 86


def exit_cause(code: int) -> str:
    """`code` as the supervisor reports it: "code 1", or with what a distinctive code means."""
    if code == MAPPED_FILE_EXIT:
        return f"code {code} (a mapped model file was truncated or replaced under it)"
    if code == PEER_LOST_EXIT:
        return f"code {code} (its heartbeat lost a ring neighbour: a silent link or a hung peer)"
    if code == -signal.SIGBUS:
        return f"code {code} (SIGBUS: a mapped file truncated or replaced under it?)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


def exit_code_for(e: BaseException) -> int:
    """The exit code of a process ending on the uncaught `e`: `PEER_LOST_EXIT` when a
    heartbeat loss is `e` or caused it (its `__cause__` / `__context__` chain), else 1."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ == "PeerLostError":  # no import: this module has no dependencies
            return PEER_LOST_EXIT
        cur = cur.__cause__ or cur.__context__
    return 1
