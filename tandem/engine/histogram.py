"""A cumulative latency histogram (Prometheus semantics: bucket counts only ever grow)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """`counts[i]` observations fell in (bounds[i-1], bounds[i]]; the last slot is above every bound."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.total += value
            self.n += 1

    def snapshot(self) -> dict:
        """{"buckets": [(le, cumulative count), ...], "sum": s, "count": n}."""
        with self._lock:
            cumulative, running = [], 0
            for bound, c in zip(self.bounds, self.counts):
                running += c
                cumulative.append((bound, running))
            return {"buckets": cumulative, "sum": self.total, "count": self.n}
