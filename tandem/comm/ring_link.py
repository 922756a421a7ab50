"""What every road of the ring shares: the two channels as one full-duplex link, the op numbering,
the broken state, and the per-shape caches of frame headers and op fingerprints.

One `RingLink` per `RingCommunicator`; the roads (`ring_tcp`, `ring_pair`, `ring_shm`) each hold
it. Every op takes the next sequence number (`begin`, or `seq += 1` on the decode paths), so the
peers' frames of one op carry the same number whichever road each rank took. After a failure
mid-op (or `close`) the link is broken: `begin` and `check_open` refuse with CommClosedError, and
the `on_fail` hooks run (the same-host road drops its lanes, so its hot path needs no check).
A peer the heartbeat declares lost (`lose`) breaks the link from the heartbeat thread and shuts
both data sockets down, so an op waiting on them wakes at once; every road then raises the
heartbeat's PeerLostError (`failed`) rather than the closed socket it woke on.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from tandem.comm import base
from tandem.comm.framing import FrameReader
from tandem.comm.staging import np_dtype
from tandem.transport.channel import Channel
from tandem.transport.heartbeat import PeerLostError
from tandem.transport.socketio import Duplex
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

_CACHE_MAX = 512  # shapes kept per cache; a model uses a handful, a hostile caller cannot grow it


class RingLink:
    """Rank `rank` of `size`: sends right, receives from the left, in the wire dtype `wire`."""

    def __init__(
        self, rank: int, size: int, left: Channel, right: Channel, wire_dtype: str, small: int
    ) -> None:
        self.rank, self.size = rank, size
        self.left, self.right = left, right
        self.wire = wd.negotiable(wire_dtype)
        self.wnp = np_dtype(self.wire)
        self.small = small  # RANK_ORDER up to this many wire bytes (`algorithms`)
        self.io = Duplex(right.ts, left.ts)
        self.reader = FrameReader(self.io.recv_into, rank, left.peer_rank, left.max_frame_bytes)
        self.seq = 0
        self.broken: str | None = None
        self.lost: PeerLostError | None = None  # set by the heartbeat thread (`lose`)
        self.on_fail: list[Callable[[], None]] = []
        self._tails: dict = {}
        self._fps: dict = {}

    def check_open(self) -> None:
        if self.broken is not None:
            raise base.CommClosedError(f"rank {self.rank}: ring is unusable: {self.broken}")

    def begin(self) -> int:
        """The next op's sequence number (refused once the link is broken)."""
        self.check_open()
        self.seq += 1
        return self.seq

    def header(
        self, op: int, code: int, seq: int, fp: int, shape: tuple[int, ...], step: int
    ) -> bytes:
        """A DATA frame's header, the shape's checked length and dims cached: this runs on every
        hop."""
        tail = self._tails.get((code, shape))
        if tail is None:
            if len(self._tails) > _CACHE_MAX:
                self._tails.clear()
            head = fr.encode_header(fr.DATA, op, code, seq, fp, shape, step)
            tail = self._tails[(code, shape)] = (
                len(shape),
                fr.FIXED.unpack_from(head)[-1],
                head[fr.FIXED_SIZE :],
            )
        ndim, nbytes, dims = tail
        return fr.pack_header(fr.DATA, op, code, ndim, step, seq, fp, nbytes, dims)

    def fingerprint(self, op: int, code: int, shape: tuple[int, ...]) -> int:
        fp = self._fps.get((op, code, shape))
        if fp is None:
            if len(self._fps) > _CACHE_MAX:
                self._fps.clear()
            fp = self._fps[(op, code, shape)] = fr.fingerprint(op, code, shape)
        return fp

    def guard(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`; any failure breaks the link before it propagates."""
        try:
            return fn(*args)
        except BaseException as e:
            err = self.failed(e)
            if err is e:
                raise
            raise err from e

    def failed(self, e: BaseException) -> BaseException:
        """Breaks the link on `e` and returns what the op raises: `e`, or, when the heartbeat
        declared a peer lost (which is what woke the op), that PeerLostError."""
        self.fail(f"{type(e).__name__}: {e}")
        lost = self.lost
        if lost is None or e is lost:
            return e
        return PeerLostError(str(lost), lost.rank)

    def fail(self, why: str) -> None:
        """Every later op refuses (`why` names the first failure)."""
        if self.broken is None:
            self.broken = why
        for hook in self.on_fail:
            hook()

    def lose(self, e: PeerLostError) -> None:
        """The heartbeat declared a peer lost (`e`): break the link and shut both data sockets
        down, so an op blocked on them returns now rather than at its op timeout."""
        self.lost = e
        self.fail(f"{type(e).__name__}: {e}")
        for ch in (self.left, self.right):
            try:
                ch.ts.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self.broken is None:
            self.fail("closed")
        self.io.close()
        self.left.close()
        self.right.close()
