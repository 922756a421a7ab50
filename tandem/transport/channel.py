"""An authenticated, framed connection to one peer: the point-to-point API.

A `Channel` is what `endpoints.connect` / `Listener.accept` return after the handshake. It sends
and receives DATA frames (header + shape + raw payload, see `tandem.wire.frame`) with a per-op
no-progress timeout. The receiver validates every header, and proves the payload length equals
what the shape allows and fits `max_frame_bytes`, before allocating the payload buffer.

The pipeline's StageTransport and the star/ring communicators use it:

    ch.send_array(op=fr.P2P, seq=7, dtype_code=wd.FLOAT32.code, shape=(1, 4, 64), payload=arr)
    header, payload = ch.recv_array(op=fr.P2P, seq=7)          # payload: bytearray, header.shape
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.transport.handshake import Identity
from tandem.transport.socketio import TimedSocket, TransportError
from tandem.wire import frame as fr


class UnexpectedFrameError(TransportError):
    """A well-formed frame that is not the one this side is waiting for (op, seq or kind desync)."""


class Channel:
    """One authenticated peer: `me` is this end's identity, `peer` the verified other end."""

    def __init__(self, ts: TimedSocket, me: Identity, peer: Identity, max_frame_bytes: int) -> None:
        self.ts, self.me, self.peer = ts, me, peer
        self.max_frame_bytes = max_frame_bytes

    @property
    def peer_rank(self) -> int:
        return self.peer.rank

    @property
    def timeout(self) -> float:
        return self.ts.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.ts.timeout = seconds

    def send_array(
        self,
        *,
        op: int,
        seq: int,
        dtype_code: int,
        shape: Sequence[int],
        payload: bytes | bytearray | memoryview,
        step: int = 0,
        fingerprint: int = 0,
    ) -> None:
        """Send one DATA frame whose payload is `shape` elements of `dtype_code` (raw bytes)."""
        header = fr.encode_header(fr.DATA, op, dtype_code, seq, fingerprint, tuple(shape), step)
        n = memoryview(payload).nbytes
        if n != fr.FIXED.unpack_from(header)[-1]:
            raise fr.FrameLengthError(
                f"payload is {n} bytes but shape {tuple(shape)} needs more or less"
            )
        self.ts.send_all([header, payload])

    def recv_header(self, max_bytes: int | None = None) -> fr.FrameHeader:
        """The next frame's validated header (payload not yet read)."""
        header, ndim = fr.decode_fixed(self.ts.recv_exact(fr.FIXED_SIZE))
        header = fr.decode_shape(header, self.ts.recv_exact(8 * ndim))
        fr.check_length(header, self.max_frame_bytes if max_bytes is None else max_bytes)
        return header

    def recv_payload_into(self, header: fr.FrameHeader, view: memoryview) -> None:
        if view.nbytes != header.payload_len:
            raise fr.FrameLengthError(
                f"buffer of {view.nbytes} bytes for a payload of {header.payload_len}"
            )
        self.ts.recv_into(view.cast("B"))

    def recv_array(
        self,
        *,
        op: int | None = None,
        seq: int | None = None,
        max_bytes: int | None = None,
    ) -> tuple[fr.FrameHeader, bytearray]:
        """The next DATA frame: header and payload. A frame of another op or seq raises
        UnexpectedFrameError before its payload is read."""
        header = self.recv_header(max_bytes)
        if (
            header.kind != fr.DATA
            or (op is not None and header.op != op)
            or (seq is not None and header.seq != seq)
        ):
            want = f"{fr.OPS.get(op, 'any op') if op is not None else 'any op'} #{seq}"
            raise UnexpectedFrameError(
                f"{self.ts.peer}: expected a DATA frame of {want}, got {header.describe()}"
            )
        payload = bytearray(header.payload_len)
        self.ts.recv_into(memoryview(payload))
        return header, payload

    def close(self) -> None:
        self.ts.close()
