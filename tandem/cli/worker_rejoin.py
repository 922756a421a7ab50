"""`tandem worker --rejoin`: a worker that outlives its head and serves the next one.

A worker process serves one group: it waits for the head to form the ring, loads its shard, runs
the head's steps, and exits when the head goes (a closed connection at once, a hung head at the op
timeout). With `--rejoin` that process is a child, started again each time it exits, by this
supervisor:

- the model memory goes with the child: when the head is lost the child exits and the operating
  system takes back its shard and caches whole (no allocator keeping freed pages), so a worker
  between heads holds only this supervisor (a small Python process that never imports torch: it
  replaces the `tandem worker` process with `os.execv` before any model code runs);
- the next child waits for the next head (the ring's handshake timeout, then it is started again);
- no crash loop: a child that exits within MIN_UP_S of starting (a refused layout, a missing
  file) is started again after a backoff that doubles from BACKOFF_START_S up to BACKOFF_MAX_S;
  one that lived longer (it served a head, or waited its whole handshake timeout) resets it.
  Each exit is one line on stderr saying what the supervisor will do next.

Ctrl-C or SIGTERM stops the child (SIGINT, SIGTERM, then SIGKILL) and the supervisor; a
supervisor killed outright takes its child along (parent-death signal).

    python -m tandem.cli.worker_rejoin worker --model DIR ...   (what `--rejoin` execs)
"""

from __future__ import annotations

import os
import sys
import time

from tandem.cluster.launcher import ProcessGroup, RankProcess, sigterm_as_keyboard_interrupt

MIN_UP_S = 10.0  # a child that exits sooner counts as failing to start
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
REJOIN_FLAG = "--rejoin"


def exec_supervisor(argv: list[str]) -> None:
    """Replaces this process with the supervisor of `tandem <argv>` (argv without `--rejoin`).
    Does not return."""
    child = [a for a in argv if a != REJOIN_FLAG]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tandem.cli.worker_rejoin", *child])


def next_delay(up_s: float, previous: float) -> float:
    """Seconds to wait before the next child, given how long the last one lived and the last
    delay: none after a child that lived MIN_UP_S, else a doubling backoff (capped)."""
    if up_s >= MIN_UP_S:
        return 0.0
    return min(BACKOFF_MAX_S, max(BACKOFF_START_S, 2 * previous))


def supervise(cmd: list[str], *, max_starts: int | None = None) -> int:
    """Runs `cmd` (`python -m tandem worker ...`) again each time it exits (see the module
    docstring); returns only on Ctrl-C / SIGTERM (130), or after `max_starts` children (tests),
    with the last exit code."""
    delay, starts, code = 0.0, 0, 0
    try:
        with sigterm_as_keyboard_interrupt():
            while max_starts is None or starts < max_starts:
                if delay:
                    _say(f"starting the worker again in {delay:g} s")
                    time.sleep(delay)
                starts += 1
                t0 = time.monotonic()
                group = ProcessGroup([RankProcess("worker", cmd)])
                try:
                    group.start()
                    _, code = group.wait(interval_s=0.1) or ("worker", 0)
                finally:
                    group.shutdown()
                up = time.monotonic() - t0
                delay = next_delay(up, delay)
                _say(
                    f"the worker exited with code {code} after {up:.1f} s (its head is gone or "
                    f"refused it); waiting for a head"
                )
    except KeyboardInterrupt:
        return 130
    return code


def _say(msg: str) -> None:
    print(f"tandem worker --rejoin: {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(supervise([sys.executable, "-m", "tandem", *sys.argv[1:]]))
