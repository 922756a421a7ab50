"""A Communicator wrapper that counts what the layers ask of the wire: collectives, bytes and time.

It forwards every call unchanged, so results are bit-identical to the wrapped backend. `bytes_moved`
is the payload the whole group puts on its links for each collective (frame headers excluded),
computed from the algorithm the ring runs (`tandem.comm.algorithms`), with `s` the tensor's size
on the float32 wire (integers at their own width) and N ranks:

    all_reduce_sum  rank order (s <= 64 KiB): every rank passes every part on, N (N-1) s
                    ring (reduce-scatter + all-gather):                     2 (N-1) s
    all_gather      every part travels N-1 hops:                            (N-1) sum_r s_r
    broadcast       a chain from the root:                                  (N-1) s
    all_to_all      each part travels (dst - src) mod N hops; counted for the parts this rank
                    sends or receives (exact for a gather to rank 0, seen from rank 0)

`seconds` is wall time inside collectives on this rank, waiting for slower peers included.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

import torch

from tandem.comm.base import Communicator

SMALL_MAX_BYTES = 64 * 1024  # the ring's rank-order cut-over (tandem.comm.algorithms)


@dataclass
class CommStats:
    collectives: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0

    def minus(self, earlier: CommStats) -> CommStats:
        return CommStats(
            self.collectives - earlier.collectives,
            self.bytes_moved - earlier.bytes_moved,
            self.seconds - earlier.seconds,
        )

    def copy(self) -> CommStats:
        return CommStats(self.collectives, self.bytes_moved, self.seconds)


def _wire_bytes(t: torch.Tensor) -> int:
    width = 4 if t.is_floating_point() else t.element_size()
    return t.numel() * width


class MeteredCommunicator:
    """Forwards to `inner`, counting per call; `stats` is cumulative."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.stats = CommStats()
        n = inner.world_size  # fixed for a communicator's life; kept off the per-op path
        self._small_factor, self._ring_factor = n * (n - 1), 2 * (n - 1)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def _count(self, t0: float, moved: int) -> None:
        self.stats.collectives += 1
        self.stats.seconds += perf_counter() - t0
        self.stats.bytes_moved += moved if self._ring_factor else 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        # the decode path's op (58 a token): `_count` and `_wire_bytes` inline, one frame less
        t0 = perf_counter()
        out = self.inner.all_reduce_sum(t)
        st = self.stats
        st.seconds += perf_counter() - t0
        st.collectives += 1
        s = t.numel() * (4 if t.is_floating_point() else t.element_size())
        st.bytes_moved += (self._small_factor if s <= SMALL_MAX_BYTES else self._ring_factor) * s
        return out

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        t0 = perf_counter()
        out = self.inner.all_gather(t, dim)
        self._count(t0, (self.world_size - 1) * _wire_bytes(out))
        return out

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        t0 = perf_counter()
        out = self.inner.reduce_scatter(t, dim)
        self._count(t0, (self.world_size - 1) * _wire_bytes(t))
        return out

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        n, r = self.world_size, self.rank
        t0 = perf_counter()
        out = self.inner.all_to_all(parts)
        sent = sum(_wire_bytes(p) * ((j - r) % n) for j, p in enumerate(parts))
        got = sum(_wire_bytes(p) * ((r - j) % n) for j, p in enumerate(out))
        self._count(t0, sent + got)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        t0 = perf_counter()
        out = self.inner.broadcast(t, src)
        self._count(t0, (self.world_size - 1) * _wire_bytes(t))
        return out

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()
