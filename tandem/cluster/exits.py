"""What a rank's exit code means, for the supervisor's messages; no dependencies (the torch- and
psutil-free single-node path raises `MAPPED_FILE_EXIT` too)."""

from __future__ import annotations

import contextlib
import signal

# a rank that read a page of a mapped model file past its end (the file truncated or replaced
# under it) exits with this code, after a line naming the file (tandem/kernels/csrc/sigbus.c)
MAPPED_FILE_EXIT = 85


def exit_cause(code: int) -> str:
    """`code` as the supervisor reports it: "code 1", or with what a distinctive code means."""
    if code == MAPPED_FILE_EXIT:
        return f"code {code} (a mapped model file was truncated or replaced under it)"
    if code == -signal.SIGBUS:
        return f"code {code} (SIGBUS: a mapped file truncated or replaced under it?)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"
