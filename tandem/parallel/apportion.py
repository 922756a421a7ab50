"""Apportionment: cutting an index space `[0, n)` into contiguous half-open spans by weight.

Pure functions, no torch. Both the TP plan (kv heads, MLP rows, vocabulary rows per rank) and the
PP partition (layers per stage under `--pp-weights`) hand out `units` indivisible units to parties
with weights `w`:

    quota_i = units * w_i / sum(w)
    count_i = floor(quota_i) + (1 if i is among the (units - sum floor) largest remainders)

(largest-remainder apportionment, Hamilton's method; equal remainders go to the lower index). The
counts then tile `[0, units * scale)` in order, party 0 first (`spans`). A count may be zero here;
each caller decides whether a party left with nothing is an error, and which one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Span:
    """The half-open range `[start, end)` of indices: layers of a stage, rows or heads of a rank's
    shard. `start` belongs to it, `end` does not; `len(span) == end - start`, and iterating yields
    the indices `start, start + 1, ..., end - 1`."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def apportion(units: int, weights: Sequence[float]) -> tuple[int, ...]:
    """`units` split in proportion to `weights` by largest remainder (ties to the lower index);
    the counts sum to `units`. Weights must be positive and finite (the callers check them, each
    with its own error)."""
    wsum = sum(weights)
    quotas = [units * w / wsum for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: units - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def spans(counts: Sequence[int], scale: int = 1) -> tuple[Span, ...]:
    """Counts -> contiguous spans from 0, the i-th `counts[i] * scale` long (scale: block size)."""
    out, start = [], 0
    for n in counts:
        out.append(Span(start * scale, (start + n) * scale))
        start += n
    return tuple(out)
