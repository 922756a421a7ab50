"""The ring's same-host road: N = 2 ranks on one machine swap their small frames through a shared
memory segment (`transport.shm`, which owns the slot protocol) instead of loopback TCP.

Two uses. `swap` carries one whole frame each way for the general road (a RANK_ORDER all-reduce's,
a small broadcast's): the peer's header must equal ours byte for byte, as on TCP. `all_reduce` is
the decode hot path: per float32 shape under the small cut-over a `transport.shm.Lane` keeps
typed views of both ranks' frames, so one call copies the payload in (from `host_tensor`, the one
host crossing), swaps, and adds the peer's payload: x + peer (= the rank-order sum: float addition
is commutative). Its frame is the one the general road would send (flat payload, step 0,
fingerprint of the real shape), so a general-road peer meets it. It is kept short because every
call on it runs with cold caches: the weight stream before each all-reduce has evicted it.

A peer that sends TCP bytes while this rank waits in shared memory has gone into another op
(`PeerDivergedError`): our header is sent on TCP too, where it waits, and both fail with
OpDesyncError.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem.comm import base, staging
from tandem.comm.framing import data_header
from tandem.comm.ring_link import RingLink
from tandem.comm.staging import to_caller
from tandem.transport import shm as same_host
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

_F32 = torch.float32
_LANES_MAX = 512


class SameHostRoad:
    """One rank's end of a same-host N = 2 ring over `pair`; float32 all-reduces of at most
    `max_numel` elements take a lane (0: none, as on a non-float32 wire)."""

    def __init__(self, link: RingLink, pair: same_host.SamePair, max_numel: int) -> None:
        self.link, self.pair, self.max_numel = link, pair, max_numel
        self._lanes: dict = {}
        link.on_fail.append(self._lanes.clear)  # a broken ring has no lane: no check per call

    def lane_for(self, t: Any) -> same_host.Lane | None:
        """The lane `t` takes (made on first use for a small float32 CPU tensor), or None."""
        if not isinstance(t, torch.Tensor):
            return None
        lane = self._lanes.get(t.shape)
        if lane is not None:
            return lane if t.dtype is _F32 else None
        if not (self.max_numel and t.dtype is _F32 and t.is_cpu and t.numel() <= self.max_numel):
            return None
        self.link.check_open()
        return self.link.guard(self._add_lane, tuple(t.shape))

    def _add_lane(self, shape: tuple[int, ...]) -> same_host.Lane:
        if len(self._lanes) > _LANES_MAX:
            self._lanes.clear()
            self.pair.forget_headers()
        n = math.prod(shape)
        fp = self.link.fingerprint(fr.ALL_REDUCE, wd.FLOAT32.code, shape)
        head = data_header(fr.ALL_REDUCE, wd.FLOAT32.code, 0, fp, (n,), 0)  # seq stored per swap

        def payload(segment: Any, at: int) -> torch.Tensor:
            return torch.frombuffer(segment, dtype=_F32, count=n, offset=at).view(shape)

        lane = self._lanes[torch.Size(shape)] = same_host.Lane(self.pair, head, 4 * n, payload)
        return lane

    def all_reduce(self, t: torch.Tensor, lane: same_host.Lane) -> torch.Tensor:
        """`t` + the peer's tensor of the same shape, through `lane` (from `lane_for(t)`)."""
        link = self.link
        p = 0
        try:
            seq = link.seq = link.seq + 1
            p = lane.begin()
            x = staging.host_tensor(t, _F32)  # t itself when CPU, contiguous, detached
            lane.mine[p].copy_(x)
            if not lane.exchange(p, seq):
                raise link.reader.desync(*lane.headers(p))
            out = torch.add(x, lane.peer[p])
        except same_host.PeerDivergedError as e:
            link.fail(f"{type(e).__name__}: {e}")
            raise self._diverged(lane.headers(p)[0], e) from None  # bytes: outlive the segment
        except BaseException as e:
            err = link.failed(e)
            if err is e:
                raise
            raise err from e
        return out if x is t else to_caller(out, t)

    def swap(self, head: bytes, payload: Any, nbytes: int) -> memoryview:
        """One frame each way (a RANK_ORDER all-reduce's, a small broadcast's); the peer's header
        must equal ours byte for byte, as on TCP. Returns the peer's payload (a view into the
        segment, read before the next op)."""
        try:
            got = self.pair.exchange(head, payload)
        except same_host.PeerDivergedError as e:
            raise self._diverged(head, e) from None
        if len(got) != len(head) + nbytes or got[: len(head)] != head:
            raise self.link.reader.desync(head, got)
        return got[len(head) :]

    def _diverged(self, head: bytes, e: same_host.PeerDivergedError) -> base.OpDesyncError:
        """The peer sent TCP bytes while we waited in shared memory: it is in another op,
        waiting on TCP, so our header goes there too (it fails closed as well)."""
        link = self.link
        try:
            link.io.send_small(head, memoryview(b""))
            link.io.flush()
        except OSError:
            pass
        if len(e.peeked) >= fr.FIXED_SIZE:
            return link.reader.desync(head, e.peeked)
        return base.OpDesyncError(f"rank {link.rank}: {e}")

    def close(self) -> None:
        self.pair.close()
