"""CPU threads per rank for the processes a local launch starts on this machine.

Every rank process owns an OpenMP pool; n pools of the machine's full size on its cores spin
against each other, and each collective then waits for a descheduled peer: measured on 2 cores,
`generate --tp 2` decoded 2.7 tok/s with a full pool per rank and 7.9 with one thread each
(`--tp 3`: 0.6 against 4.1). So co-located ranks split the cores the process may run on
(OMP_NUM_THREADS, when set, caps the total), at least one thread each.
"""

from __future__ import annotations

import os


def machine_threads() -> int:
    """The threads this machine gives a launch: OMP_NUM_THREADS when set, else the cores this
    process may run on (its affinity mask, else the CPU count)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_threads(n_ranks: int) -> int:
    """Threads per rank when `n_ranks` rank processes share this machine (at least 1)."""
    return max(1, machine_threads() // max(1, n_ranks))
