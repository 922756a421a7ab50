"""A star rooted at rank 0: every collective is one gather to the root and one scatter back.

Rank 0 listens; ranks 1..N-1 dial it (with retry and backoff) through the HMAC handshake. The
root reduces in rank order, ((x_0 + x_1) + x_2) + ..., in float32 (algorithm RANK_ORDER of
`algorithms.py`), so the star equals `reference` with algorithm="star" bit for bit, and every rank
receives the root's one encoding of the result. Two hops of latency, and the root moves N-1 times
the tensor each way: the star suits small N and small tensors (decode steps), the ring large ones.

    comm = StarCommunicator.create(rank, world_size, root=("10.0.0.1", 29500), secret=b"...",
                                   cluster_id="c1", wire_dtype="float32", model_fingerprint="")

Rank 0 binds `root` (or takes a bound `listener=`). Errors as for the ring.

With `heartbeat_timeout` > 0 (default 3 s, 0: none) each worker also has a heartbeat connection
to the root (`star_beats.form_star_heartbeats`, `transport.heartbeat`): a peer silent that long
(a worker, on the root; the root, on a worker) breaks the star and shuts its data sockets down,
so an op waiting on them fails at once with PeerLostError naming it, rather than at the op
timeout; `lost()` says why from that moment, idle or mid-op.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import torch

from tandem.cluster.ring_config import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    check_heartbeat_timeout,
    check_timeout,
)
from tandem.comm import base
from tandem.comm.framing import (
    ABORT_STEP,
    CLAIM_STEP,
    FrameReader,
    check_gathered_shape,
    data_header,
)
from tandem.comm.moves import StagedMoves
from tandem.comm.staging import (
    decode_f32,
    encode_f32,
    np_dtype,
    stage_to_host,
    unstage,
)
from tandem.comm.star_beats import form_star_heartbeats
from tandem.transport.channel import Channel
from tandem.transport.endpoints import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_OP_TIMEOUT_S,
    Listener,
    connect,
)
from tandem.transport.handshake import Identity
from tandem.transport.heartbeat import Heartbeat, PeerLostError
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr


class StarCommunicator(StagedMoves):
    """Rank `rank` of a star; the root holds one channel per worker, a worker one to the root.
    The movement ops' envelope (check, encode, number, fingerprint, decode) is
    `moves.StagedMoves`'."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        channels: dict[int, Channel],
        wire_dtype: str,
        heartbeats: list[Channel] | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self._rank, self._size = rank, world_size
        self._ch = channels  # peer rank -> channel
        self._wire = wd.negotiable(wire_dtype)
        self._readers = {
            j: FrameReader(c.ts.recv_into, rank, j, c.max_frame_bytes) for j, c in channels.items()
        }
        self._seq = 0
        self._broken: str | None = None
        self._lost: PeerLostError | None = None  # set by the heartbeat thread (`_lose`)
        self._heartbeat = (
            Heartbeat(rank, heartbeats, heartbeat_timeout, self._lose) if heartbeats else None
        )

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        root: tuple[str, int],
        listener: Listener | None = None,
        secret: bytes | None = None,
        cluster_id: str = "tandem",
        wire_dtype: str = "float32",
        model_fingerprint: str = "",
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        op_timeout: float = DEFAULT_OP_TIMEOUT_S,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> StarCommunicator:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"a star needs world_size >= 2 and 0 <= rank < world_size, got {rank}/{world_size}"
            )
        check_timeout("op_timeout", op_timeout, "star")
        check_timeout("handshake_timeout", handshake_timeout, "star")
        check_heartbeat_timeout(heartbeat_timeout, "star")
        me = Identity(cluster_id, rank, world_size, wire_dtype, model_fingerprint, "star")
        kw = dict(op_timeout=op_timeout, max_frame_bytes=max_frame_bytes)
        channels: dict[int, Channel] = {}
        if rank == 0:
            if listener is None:
                listener = Listener(root[0], root[1], me, secret)
            else:
                listener.me, listener.secret = me, secret
            try:
                while len(channels) < world_size - 1:
                    want = set(range(1, world_size)) - set(channels)
                    ch = listener.accept(want, timeout=handshake_timeout, **kw)
                    channels[ch.peer_rank] = ch
            except BaseException:
                for c in channels.values():
                    c.close()
                raise
            finally:
                listener.close()
        else:
            channels[0] = connect(
                root[0],
                root[1],
                me,
                secret,
                expect_rank=0,
                handshake_timeout=handshake_timeout,
                **kw,
            )
        beats = None
        if heartbeat_timeout > 0:
            host = listener.host if rank == 0 else root[0]
            try:
                beats = form_star_heartbeats(me, channels, host, secret, handshake_timeout)
            except BaseException:
                for c in channels.values():
                    c.close()
                raise
        return cls(rank, world_size, channels, wire_dtype, beats, heartbeat_timeout)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def _begin(self) -> int:
        if self._broken is not None:
            raise base.CommClosedError(f"rank {self._rank}: star is unusable: {self._broken}")
        self._seq += 1
        return self._seq

    def _run(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as e:
            if self._broken is None:
                self._broken = f"{type(e).__name__}: {e}"
            lost = self._lost
            if lost is not None and e is not lost:  # what woke the op: a peer the heartbeat lost
                raise PeerLostError(str(lost), lost.rank) from e
            raise

    def _lose(self, e: PeerLostError) -> None:
        """The heartbeat declared peer `e.rank` lost (on its thread): break the star and shut
        every data socket down, so an op blocked on one returns now."""
        self._lost = e
        self._broken = f"{type(e).__name__}: {e}"
        for c in self._ch.values():
            try:
                c.ts.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def lost(self) -> str | None:
        """Why the heartbeat declared a peer lost (naming its rank), or None."""
        return None if self._lost is None else str(self._lost)

    def _fingerprint(self, op: int, code: int, shape: tuple[int, ...]) -> int:
        return fr.fingerprint(op, code, shape)

    def _send(self, j: int, head: bytes, payload: Any) -> None:
        self._ch[j].ts.send_all([head, payload])

    def _recv(self, j: int, head: bytes, n: int, dtype: np.dtype) -> np.ndarray:
        out = np.empty(n, dtype=dtype)
        self._readers[j].known(head, memoryview(out))
        return out

    # ----------------------------------------------------------------------------- reductions

    def _sum(self, x: np.ndarray, op: int, seq: int, fp: int, parts: int) -> np.ndarray:
        """Rank-order sum at the root; each worker gets all of it (parts=1) or its 1/N (parts=N)."""
        wire, n, size = self._wire, x.size, self._size
        w = np_dtype(wire)
        mine = encode_f32(x, wire)
        up = data_header(op, wire.code, seq, fp, (n,), 0)
        m = n // parts
        if self._rank != 0:
            self._send(0, up, mine)
            got = self._recv(0, data_header(op, wire.code, seq, fp, (m,), 1), m, w)
            return decode_f32(got, wire)
        acc = decode_f32(mine, wire).copy()
        for j in range(1, size):
            np.add(acc, decode_f32(self._recv(j, up, n, w), wire), out=acc)
        result = encode_f32(acc, wire)
        down = data_header(op, wire.code, seq, fp, (m,), 1)
        for j in range(1, size):
            self._send(j, down, result[j * m : (j + 1) * m] if parts > 1 else result)
        return decode_f32(result[:m], wire)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        base.check_tensor(t, "all_reduce_sum", reduce=True)
        x = stage_to_host(t, torch.float32)
        seq = self._begin()
        fp = fr.fingerprint(fr.ALL_REDUCE, self._wire.code, tuple(t.shape))
        out = self._run(self._sum, x, fr.ALL_REDUCE, seq, fp, 1)
        return unstage(np.array(out, dtype=np.float32), tuple(t.shape), t)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "reduce_scatter", reduce=True)
        d = base.check_dim(t, dim, "reduce_scatter")
        part = base.check_divisible(t, d, self._size, "reduce_scatter")
        moved = t.movedim(d, 0)
        x = stage_to_host(moved, torch.float32)
        seq = self._begin()
        fp = fr.fingerprint(fr.REDUCE_SCATTER, self._wire.code, (*t.shape, d))
        out = self._run(self._sum, x, fr.REDUCE_SCATTER, seq, fp, self._size)
        host = np.array(out, dtype=np.float32)
        return unstage(host, (part, *moved.shape[1:]), t).movedim(0, d).contiguous()

    def barrier(self) -> None:
        seq = self._begin()
        fp = fr.fingerprint(fr.BARRIER, self._wire.code, (1,))
        self._run(self._sum, np.zeros(1, dtype=np.float32), fr.BARRIER, seq, fp, 1)

    # ----------------------------------------------------------------------------- movement

    def _gather_blocks(
        self, wire: wd.WireDtype, payload: np.ndarray, shape: tuple, d: int, seq: int, fp: int
    ) -> list:
        op, size = fr.ALL_GATHER, self._size
        if self._rank != 0:
            self._send(0, data_header(op, wire.code, seq, fp, shape, 0), payload)
            blocks = []
            for i in range(size):
                header, got = self._readers[0].any(op, seq, fp, 1 + i)
                check_gathered_shape(header, wire.code, shape, d, i)
                blocks.append((header.shape, got.view(np_dtype(wire))))
            return blocks
        blocks = [(shape, payload)]
        for j in range(1, size):
            header, got = self._readers[j].any(op, seq, fp, 0)
            check_gathered_shape(header, wire.code, shape, d, j)
            blocks.append((header.shape, got.view(np_dtype(wire))))
        for j in range(1, size):
            for i, (s, p) in enumerate(blocks):
                self._send(j, data_header(op, wire.code, seq, fp, s, 1 + i), p)
        return blocks

    def _broadcast(
        self, wire: wd.WireDtype, payload: np.ndarray, shape: tuple, src: int, seq: int, fp: int
    ) -> np.ndarray:
        """Through the root. Every worker sends the root one frame (its payload if it is `src`,
        else a header-only claim) and gets one back (the payload, or a claim if it is `src`);
        the fingerprint binds shape, dtype and root, so ranks that disagree on the root fail with
        OpDesyncError instead of each returning its own tensor. A root that finds a disagreement
        before it has answered sends every worker an abort frame, which fails them too."""
        op, r = fr.BROADCAST, self._rank
        up = data_header(op, wire.code, seq, fp, shape, 0)
        down = data_header(op, wire.code, seq, fp, shape, 1)
        claim = data_header(op, wire.code, seq, fp, (0,), CLAIM_STEP)
        empty = np.empty(0, dtype=np.uint8)
        if r != 0:
            if r == src:
                self._send(0, up, payload)
                self._recv(0, claim, 0, np.uint8)
                return payload
            self._send(0, claim, empty)
            return self._recv(0, down, payload.size, payload.dtype)
        workers = range(1, self._size)
        if src == 0:  # answer first: the workers wait for nothing but the payload
            for j in workers:
                self._send(j, down, payload)
            for j in workers:
                self._recv(j, claim, 0, np.uint8)
            return payload
        try:
            for j in workers:
                if j == src:
                    payload = self._recv(j, up, payload.size, payload.dtype)
                else:
                    self._recv(j, claim, 0, np.uint8)
        except base.OpDesyncError:
            abort = data_header(op, wire.code, seq, fp, (0,), ABORT_STEP)
            for j in workers:
                try:
                    self._send(j, abort, empty)
                except OSError:
                    pass
            raise
        for j in workers:
            self._send(j, claim if j == src else down, empty if j == src else payload)
        return payload

    def _all_to_all(self, wire: wd.WireDtype, items: list, seq: int, fp: int) -> list:
        """Workers send every part to the root (step = destination); the root routes part i->k
        to rank k (step = source)."""
        op, size, w = fr.ALL_TO_ALL, self._size, np_dtype(wire)
        if self._rank != 0:
            for k, (s, p) in enumerate(items):
                self._send(0, data_header(op, wire.code, seq, fp, s, k), p)
            out = []
            for i in range(size):
                header, got = self._readers[0].any(op, seq, fp, i)
                out.append((header.shape, got.view(w)))
            return out
        table = [items]  # table[i][k]: part from rank i to rank k
        for j in range(1, size):
            row = []
            for k in range(size):
                header, got = self._readers[j].any(op, seq, fp, k)
                row.append((header.shape, got.view(w)))
            table.append(row)
        for k in range(1, size):
            for i in range(size):
                s, p = table[i][k]
                self._send(k, data_header(op, wire.code, seq, fp, s, i), p)
        return [table[i][0] for i in range(size)]

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._broken is None:
            self._broken = "closed"
        for c in self._ch.values():
            c.close()
