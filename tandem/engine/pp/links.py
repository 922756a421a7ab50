"""Opening pipeline stage links over the authenticated transport (`tandem.transport`).

Every process of a pipeline grid has a global rank: stage k's TP rank r is
`sum(tp sizes of stages < k) + r`, so the head is rank 0. A link is one `Channel` (mutual HMAC
handshake, claims bound to the secret: cluster id, world size, wire dtype, model fingerprint, and the
role "pipeline", so a ring channel cannot be mistaken for a stage link). Each stage frame travels as
one DATA frame of op P2P whose `seq` counts the frames on that link, so a lost or reordered frame is
caught at once, and whose size is bounded by what a step of this model can carry.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.pp.frames import StageLinkError, TcpStageTransport
from tandem.transport.channel import Channel
from tandem.transport.endpoints import Listener, connect
from tandem.transport.handshake import Identity
from tandem.transport.socketio import TransportError
from tandem.wire import dtypes
from tandem.wire import frame as fr

ROLE = "pipeline"


@dataclass(frozen=True)
class LinkTerms:
    """What every process of one pipeline agrees on (and proves in the handshake)."""

    cluster_id: str
    world_size: int
    wire_dtype: str = "float32"
    model_fingerprint: str = ""
    secret: bytes | None = None
    handshake_timeout: float = 120.0
    op_timeout: float = 120.0
    max_frame_bytes: int = 1 << 30

    def identity(self, rank: int) -> Identity:
        return Identity(
            self.cluster_id, rank, self.world_size, self.wire_dtype, self.model_fingerprint, ROLE
        )


def max_frame_bytes(max_batch: int, max_tokens: int, hidden_size: int) -> int:
    """The largest stage frame a step can need: (B, T, D) float32 plus its header and table."""
    return 4 * max_batch * max_tokens * hidden_size + 16 * max_batch + 64


class ChannelConnection:
    """`FramedConnection` over a `Channel`: one P2P DATA frame per stage frame, numbered."""

    frame_overhead = fr.FIXED_SIZE + 8  # the DATA frame's header and its one shape dim

    def __init__(self, ch: Channel, max_bytes: int) -> None:
        self.ch = ch
        self.max_bytes = max_bytes
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()

    def send_frame(self, payload: bytes) -> None:
        with self._lock:
            seq = self._send_seq
            self._send_seq += 1
        self.ch.send_array(
            op=fr.P2P, seq=seq, dtype_code=dtypes.UINT8.code, shape=(len(payload),), payload=payload
        )

    def recv_frame(self, timeout: float | None = None) -> bytes:
        if timeout is not None:
            self.ch.timeout = timeout
        try:
            _, payload = self.ch.recv_array(op=fr.P2P, seq=self._recv_seq, max_bytes=self.max_bytes)
        except (TransportError, fr.FrameError) as e:
            raise StageLinkError(f"link from rank {self.ch.peer_rank}: {e}") from e
        self._recv_seq += 1
        return bytes(payload)

    def shutdown(self) -> None:
        """Shuts the socket down both ways: a thread waiting on it wakes (`TcpStageTransport`)."""
        try:
            self.ch.ts.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.ch.close()


class StageListener:
    """This process's listening socket for its upstream link(s)."""

    def __init__(self, terms: LinkTerms, rank: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self.terms, self.rank = terms, rank
        self._listener = Listener(host, port, terms.identity(rank), terms.secret)

    @property
    def port(self) -> int:
        return self._listener.port

    def accept(self, from_rank: int, name: str) -> TcpStageTransport:
        t = self.terms
        try:
            ch = self._listener.accept(
                {from_rank},
                timeout=t.handshake_timeout,
                op_timeout=t.op_timeout,
                max_frame_bytes=t.max_frame_bytes,
            )
        except TransportError as e:
            raise StageLinkError(f"{name}: {e}") from e
        return TcpStageTransport(ChannelConnection(ch, t.max_frame_bytes), name)

    def close(self) -> None:
        self._listener.close()


def dial(terms: LinkTerms, rank: int, addr: str, to_rank: int, name: str) -> TcpStageTransport:
    """An authenticated link from `rank` to the process `to_rank` listening at `addr` (host:port)."""
    host, _, port = addr.rpartition(":")
    try:
        ch = connect(
            host,
            int(port),
            terms.identity(rank),
            terms.secret,
            expect_rank=to_rank,
            handshake_timeout=terms.handshake_timeout,
            op_timeout=terms.op_timeout,
            max_frame_bytes=terms.max_frame_bytes,
        )
    except TransportError as e:
        raise StageLinkError(f"{name}: {e}") from e
    return TcpStageTransport(ChannelConnection(ch, terms.max_frame_bytes), name)


def dial_all(
    terms: LinkTerms, rank: int, addrs: Sequence[str], to_ranks: Sequence[int], name: str
) -> list[TcpStageTransport]:
    return [dial(terms, rank, a, r, f"{name} -> rank {r}") for a, r in zip(addrs, to_ranks)]


def grid_ranks(layout: Sequence[int]) -> list[list[int]]:
    """Global ranks of each stage's TP ranks: layout (2, 1) -> [[0, 1], [2]]."""
    out, r = [], 0
    for tp in layout:
        out.append(list(range(r, r + tp)))
        r += tp
    return out
