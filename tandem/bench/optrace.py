"""Per-collective timestamps on every rank, and what they say once the ranks' traces are lined up.

Every rank of a TP group runs the same collectives in the same order, and `time.perf_counter()` is
CLOCK_MONOTONIC, one clock for every process on the machine (network namespaces included). So for
collective i with enter/exit times e_r, x_r on rank r:

    sync_i = min_r x_r - max_r e_r     the op itself, from the last rank's arrival to the first
                                       rank's return: staging, wire, reduction; no waiting
    skew_i = max_r e_r - min_r e_r     how long the first rank waited for the last to arrive
                                       (compute imbalance and scheduling noise, not the link)

Summed over the decode phase and divided by the tokens, these are synchronization per token and
waiting per token, measured in place rather than by subtracting two noisy wall times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tandem.comm.base import Communicator


class TracedCommunicator:
    """Forwards to `inner` unchanged, appending (op, enter, exit) for every collective."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.ops: list[tuple[str, float, float]] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def _traced(self, name: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.ops.append((name, t0, time.perf_counter()))
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        # the decode path's op, traced without the generic wrapper's extra call
        t0 = time.perf_counter()
        out = self.inner.all_reduce_sum(t)
        self.ops.append(("all_reduce_sum", t0, time.perf_counter()))
        return out

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._traced("all_gather", self.inner.all_gather, t, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._traced("reduce_scatter", self.inner.reduce_scatter, t, dim)

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._traced("all_to_all", self.inner.all_to_all, parts)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._traced("broadcast", self.inner.broadcast, t, src)

    def barrier(self) -> None:
        self._traced("barrier", self.inner.barrier)

    def close(self) -> None:
        self.inner.close()

    def dump(self, path: str | Path, marks: dict | None = None) -> None:
        doc = {"rank": self.rank, "ops": self.ops, "marks": marks or {}}
        Path(path).write_text(json.dumps(doc))


class TraceMismatchError(ValueError):
    """The ranks' traces do not list the same collectives in the same order."""


def analyze_traces(traces: list[dict], start: int, end: int) -> dict:
    """Sums sync_i and skew_i (module docstring) over collectives [start, end) of every rank's
    trace; also per op kind."""
    if not traces:
        raise TraceMismatchError("no traces")
    n = min(len(t["ops"]) for t in traces)
    if end > n or start < 0 or start > end:
        raise TraceMismatchError(f"range [{start}, {end}) outside the common {n} collectives")
    sync = skew = 0.0
    by_kind: dict[str, dict] = {}
    for i in range(start, end):
        names = {t["ops"][i][0] for t in traces}
        if len(names) != 1:
            raise TraceMismatchError(f"collective {i} differs across ranks: {sorted(names)}")
        enters = [t["ops"][i][1] for t in traces]
        exits = [t["ops"][i][2] for t in traces]
        s = max(0.0, min(exits) - max(enters))
        sync += s
        skew += max(enters) - min(enters)
        k = by_kind.setdefault(names.pop(), {"count": 0, "sync_s": 0.0})
        k["count"] += 1
        k["sync_s"] += s
    return {"collectives": end - start, "sync_s": sync, "skew_s": skew, "by_kind": by_kind}
