"""The host-staged TCP ring: a Communicator any device can join (cuda, rocm, mps, xpu, cpu).

Rank r listens for its left neighbour (r-1) and dials its right neighbour (r+1), both through the
HMAC handshake; for N = 2 the two ranks hold two connections, one per direction, and when they
share a host they swap their small frames (RANK_ORDER all-reduces, small broadcasts) through
shared memory instead (`transport.shm`: the same frames, the same checks). Every tensor crosses
to the host through `staging` (its `host_tensor`), travels in the negotiated wire dtype (float32
by default), is reduced in float32, and returns on the caller's device in the caller's dtype.

All-reduce (and reduce-scatter) pick their algorithm from (wire bytes, N) alone, so every rank
agrees (`algorithms.choose_all_reduce`):
- RANK_ORDER, small tensors: a ring all-gather of whole tensors (N-1 hops; for N = 2 a single
  exchange), then every rank sums all N in rank order: one hop of latency at N = 2.
- RING, large tensors: reduce-scatter then all-gather over N chunks (each rank sends 2(N-1)/N of
  the tensor); arriving segments are reduced while later bytes are still on the wire.
Every rank ends with bit-identical values equal to `reference` for the same algorithm. Frames
carry the op, sequence number, step and an op fingerprint (op, dtype, shape): ranks that call
different ops or shapes fail with OpDesyncError at the first frame, before any payload is read.

Programmatic construction (spawned workers, tests):

    comm = RingCommunicator.create(
        rank, world_size, right=("10.0.0.2", 29501), listen=("0.0.0.0", 29500),
        secret=b"...", cluster_id="c1", wire_dtype="float32", model_fingerprint="sha256:...",
        handshake_timeout=120.0, op_timeout=60.0)

`listen=` may be replaced by `listener=` (a bound `transport.endpoints.Listener`, e.g. on port 0
so the port can be reported before the ring forms). Failures raise CommError subclasses (base)
or transport errors (PeerClosedError, PeerTimeoutError, AuthError, ...); after a failure mid-op
the communicator is broken and refuses further ops with CommClosedError.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np
import torch

from tandem.cluster.ring_config import check_timeout
from tandem.comm import algorithms as alg
from tandem.comm import base
from tandem.comm.framing import (
    ABORT_STEP,
    CLAIM_STEP,
    FrameReader,
    check_gathered_shape,
    data_header,
)
from tandem.comm.staging import (
    decode_f32,
    decode_tensor,
    encode_f32,
    encode_tensor,
    host_tensor,
    np_dtype,
    stage_to_host,
    to_caller,
    unstage,
)
from tandem.transport import shm as same_host
from tandem.transport.channel import Channel
from tandem.transport.endpoints import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_OP_TIMEOUT_S,
    Listener,
    connect,
)
from tandem.transport.handshake import Identity
from tandem.transport.socketio import Duplex
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

_SEGMENT_BYTES = 256 * 1024  # reduce arriving data in cache-sized pieces

_F32 = torch.float32


def same_host_cap(small_max_bytes: int) -> int:
    """The same-host slot: the largest small frame (header with 8 dims + payload)."""
    return fr.FIXED_SIZE + 8 * fr.MAX_NDIM + small_max_bytes


class _PairPlan:
    """Per tensor shape, what the N = 2 fast path reuses: the frame's fingerprint and shape bytes,
    and a receive buffer (header + payload) the peer's frame lands in."""

    __slots__ = ("fp", "dims", "nbytes", "buf", "view", "payload", "expect", "checked", "_reader")

    def __init__(self, fp: int, dims: bytes, nbytes: int, reader: FrameReader) -> None:
        self.fp, self.dims, self.nbytes, self._reader = fp, dims, nbytes, reader
        self.buf = bytearray(fr.FIXED_SIZE + len(dims) + nbytes)
        self.view = memoryview(self.buf)
        self.payload = np.frombuffer(self.buf, np.float32, offset=fr.FIXED_SIZE + len(dims))
        self.expect, self.checked = b"", False

    def check(self, got: int) -> None:
        """The fixed header as soon as it has arrived: a peer in another op fails at once."""
        if not self.checked and got >= fr.FIXED_SIZE:
            self.checked = True
            if self.view[: fr.FIXED_SIZE] != self.expect[: fr.FIXED_SIZE]:
                raise self._reader.desync(self.expect, self.buf)


class _ShmLane:
    """Per tensor shape, the same-host fast path's views into the pair segment: for each slot
    parity, this rank's and the peer's frame (header bytes at `mine_at` / `peer_at`, payload as a
    float32 tensor of the shape), the header with seq 0, the word holding this rank's seq, and the
    slot words (`SamePair.slot_word`: swap number, then length) of this rank and of the peer."""

    __slots__ = (
        "head", "hlen", "length", "mine_at", "peer_at", "seq_word", "mine", "peer", "mm", "words",
        "my_slot", "peer_slot",
    )  # fmt: skip

    def __init__(self, pair: same_host.SamePair, fp: int, shape: tuple[int, ...]) -> None:
        n = math.prod(shape)
        # the frame of the general path (_sum_rank_order: flat payload, step 0), seq left 0
        head = data_header(fr.ALL_REDUCE, wd.FLOAT32.code, 0, fp, (n,), 0)
        self.head, self.hlen, self.length = head, len(head), len(head) + 4 * n
        self.mm, self.words = pair.buffer, pair.words
        self.mine_at = tuple(pair.frame_offset(True, p) for p in (0, 1))
        self.peer_at = tuple(pair.frame_offset(False, p) for p in (0, 1))
        self.seq_word = tuple((at + fr.SEQ_OFFSET) // 8 for at in self.mine_at)
        self.my_slot = tuple(pair.slot_word(True, p) for p in (0, 1))
        self.peer_slot = tuple(pair.slot_word(False, p) for p in (0, 1))

        def payload(at: int) -> torch.Tensor:
            return torch.frombuffer(
                pair.buffer, dtype=torch.float32, count=n, offset=at + self.hlen
            ).view(shape)

        self.mine = tuple(payload(at) for at in self.mine_at)
        self.peer = tuple(payload(at) for at in self.peer_at)


class RingCommunicator:
    """Rank `rank` of a `world_size` ring over two authenticated channels (left, right)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        left: Channel,
        right: Channel,
        *,
        wire_dtype: str = "float32",
        small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
        same_host_pair: same_host.SamePair | None = None,
    ) -> None:
        self._rank, self._size = rank, world_size
        self._left, self._right = left, right
        self._wire = wd.negotiable(wire_dtype)
        self._wnp = np_dtype(self._wire)
        self._small = small_max_bytes
        self._io = Duplex(right.ts, left.ts)
        self._seq = 0
        self._broken: str | None = None
        self._tails: dict = {}
        self._buffers: dict[str, np.ndarray] = {}
        self._spare: np.ndarray | None = None
        self._fps: dict = {}
        self._pairs: dict = {}
        # the N = 2 float32 fast path's limit in elements (0: off); see _pair_sum
        self._pair_max = (
            small_max_bytes // 4 if world_size == 2 and self._wire.code == wd.FLOAT32.code else 0
        )
        self._reader = FrameReader(self._io.recv_into, rank, left.peer_rank, left.max_frame_bytes)
        # N = 2 on one host: small all-reduces and broadcasts swap through shared memory
        self._shm = same_host_pair if world_size == 2 else None
        self._lanes: dict = {}

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        right: tuple[str, int],
        listen: tuple[str, int] | None = None,
        listener: Listener | None = None,
        secret: bytes | None = None,
        cluster_id: str = "tandem",
        wire_dtype: str = "float32",
        model_fingerprint: str = "",
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        op_timeout: float = DEFAULT_OP_TIMEOUT_S,
        small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        shared_memory: bool | None = None,
    ) -> RingCommunicator:
        """Form the ring: accept the left neighbour while dialing the right one (with retry until
        `handshake_timeout`), then close the listening socket. At N = 2 the ranks then agree on
        same-host shared memory for small all-reduces (`transport.shm`): on when both ranks
        allow it (`shared_memory`, None: env TANDEM_SHM, default on) and share a host."""
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"a ring needs world_size >= 2 and 0 <= rank < world_size, got {rank}/{world_size}"
            )
        check_timeout("op_timeout", op_timeout, "ring")
        check_timeout("handshake_timeout", handshake_timeout, "ring")
        wd.negotiable(wire_dtype)
        me = Identity(cluster_id, rank, world_size, wire_dtype, model_fingerprint, "ring")
        if listener is None:
            if listen is None:
                raise ValueError("RingCommunicator.create needs listen=(host, port) or listener=")
            listener = Listener(listen[0], listen[1], me, secret)
        else:
            listener.me, listener.secret = me, secret
        got: dict[str, Any] = {}

        def dial() -> None:
            try:
                got["right"] = connect(
                    right[0], right[1], me, secret, expect_rank=(rank + 1) % world_size,
                    handshake_timeout=handshake_timeout, op_timeout=op_timeout,
                    max_frame_bytes=max_frame_bytes,
                )  # fmt: skip
            except BaseException as e:  # re-raised on the forming thread below
                got["error"] = e

        dialer = threading.Thread(target=dial, name=f"ring-dial-{rank}", daemon=True)
        dialer.start()
        try:
            left = listener.accept(
                {(rank - 1) % world_size},
                timeout=handshake_timeout,
                op_timeout=op_timeout,
                max_frame_bytes=max_frame_bytes,
                give_up=lambda: got.get("error"),  # a refused dial fails the ring at once
            )
        except BaseException:
            dialer.join()
            if "right" in got:
                got["right"].close()
            raise
        finally:
            listener.close()
        dialer.join()
        if "error" in got:
            left.close()
            raise got["error"]
        pair = None
        if world_size == 2:
            try:
                pair = same_host.negotiate(
                    rank, got["right"], left, same_host_cap(small_max_bytes),
                    same_host.enabled_from_env() if shared_memory is None else shared_memory,
                )  # fmt: skip
            except BaseException:
                left.close()
                got["right"].close()
                raise
        return cls(
            rank,
            world_size,
            left,
            got["right"],
            wire_dtype=wire_dtype,
            small_max_bytes=small_max_bytes,
            same_host_pair=pair,
        )

    @property
    def same_host(self) -> bool:
        """True when this N = 2 ring swaps its small all-reduces through shared memory."""
        return self._shm is not None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    # ----------------------------------------------------------------------------- framing

    def _begin(self) -> int:
        if self._broken is not None:
            raise base.CommClosedError(f"rank {self._rank}: ring is unusable: {self._broken}")
        self._seq += 1
        return self._seq

    def _header(
        self, op: int, code: int, seq: int, fp: int, shape: tuple[int, ...], step: int
    ) -> bytes:
        """data_header(...), with the shape's bytes cached: this runs on every hop."""
        tail = self._tails.get((code, shape))
        if tail is None:
            if len(self._tails) > 512:
                self._tails.clear()
            head = data_header(op, code, seq, fp, shape, step)
            tail = self._tails[(code, shape)] = (
                len(shape),
                fr.FIXED.unpack_from(head)[-1],
                head[fr.FIXED_SIZE :],
            )
        ndim, nbytes, dims = tail
        return (
            fr.FIXED.pack(
                fr.MAGIC, fr.PROTOCOL_VERSION, fr.DATA, op, code, ndim, step, 0, seq, fp, nbytes
            )
            + dims
        )

    def _buffer(self, name: str, n: int, dtype: np.dtype) -> np.ndarray:
        """An internal work buffer of at least n elements, kept across ops: large fresh buffers
        cost a page fault and a zeroed page per 4 KB on every call."""
        buf = self._buffers.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = np.empty(n, dtype=dtype)
            self._buffers[name] = buf
        return buf[:n]

    def _output(self, n: int) -> np.ndarray:
        """The float32 array a large all-reduce returns in. The previous one is reused only when
        nothing outside this object still refers to it (the caller dropped the returned tensor
        and every view of it), so a result the caller holds is never overwritten."""
        spare = self._spare
        self._spare = None
        if spare is not None and spare.size == n and sys.getrefcount(spare) == 2:
            out = spare
        else:
            del spare
            out = np.empty(n, dtype=np.float32)
        self._spare = out
        return out

    def _fingerprint(self, op: int, code: int, shape: tuple[int, ...]) -> int:
        fp = self._fps.get((op, code, shape))
        if fp is None:
            if len(self._fps) > 512:
                self._fps.clear()
            fp = self._fps[(op, code, shape)] = fr.fingerprint(op, code, shape)
        return fp

    def _recv_known(self, expect: bytes, payload: memoryview, on_progress: Any = None) -> None:
        self._reader.known(expect, payload, on_progress)

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as e:
            self._break(f"{type(e).__name__}: {e}")
            raise

    def _break(self, why: str) -> None:
        """After a failure mid-op (or close) every later op refuses: the general paths check
        `_broken`, and the same-host fast path loses its lanes."""
        self._broken = why
        self._lanes.clear()

    # ----------------------------------------------------------------------------- all-reduce

    def _sum_rank_order(self, x: np.ndarray, op: int, seq: int, fp: int) -> np.ndarray:
        """RANK_ORDER: ring all-gather of whole wire payloads, then q(sum in rank order)."""
        n, size, r, wire = x.size, self._size, self._rank, self._wire
        blocks: list[Any] = [None] * size
        blocks[r] = encode_f32(x, wire)
        hops = size - 1
        if self._shm is not None and n * wire.itemsize <= self._small:  # N = 2 on one host
            head = self._header(op, wire.code, seq, fp, (n,), 0)
            got = self._swap_same_host(head, blocks[r], n * wire.itemsize)
            blocks[1 - r], hops = np.frombuffer(got, self._wnp), 0
        for s in range(hops):
            head = self._header(op, wire.code, seq, fp, (n,), s)
            self._io.send([head, blocks[(r - s) % size]])
            blocks[(r - s - 1) % size] = self._reader.known_small(
                head, n * wire.itemsize, self._wnp
            )
        self._io.flush()
        acc = np.add(decode_f32(blocks[0], wire), decode_f32(blocks[1], wire))
        for j in range(2, size):
            np.add(acc, decode_f32(blocks[j], wire), out=acc)
        if wire.code != wd.FLOAT32.code:
            acc = decode_f32(encode_f32(acc, wire), wire)
        return acc

    def _pair_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The decode hot path: N = 2, a small float32 host tensor, the float32 wire. One frame
        each way, sent before anything else is done; the sum is `x + peer`, which equals the
        RANK_ORDER sum x_0 + x_1 bit for bit on both ranks (float addition is commutative). Every
        check of the general path holds: the peer's header must equal ours byte for byte (op,
        sequence number, step, fingerprint of op/dtype/shape; the fixed part as soon as it has
        arrived), else OpDesyncError. Frames are those of `_sum_rank_order`."""
        if self._broken is not None:
            raise base.CommClosedError(f"rank {self._rank}: ring is unusable: {self._broken}")
        self._seq += 1
        plan = self._pairs.get(t.shape)
        if plan is None:
            plan = self._pair_plan(tuple(t.shape))
        x = stage_to_host(t, torch.float32)  # aliases t: no copy
        head = (
            fr.FIXED.pack(
                fr.MAGIC,
                fr.PROTOCOL_VERSION,
                fr.DATA,
                fr.ALL_REDUCE,
                wd.FLOAT32.code,
                1,
                0,
                0,
                self._seq,
                plan.fp,
                plan.nbytes,
            )
            + plan.dims
        )
        self._io.send_small(head, x)
        plan.expect, plan.checked = head, False
        self._io.recv_small(plan.view, plan.check)
        if plan.view[: len(head)] != head:
            raise self._reader.desync(head, plan.buf)
        out = np.add(x, plan.payload)
        self._io.flush()  # a no-op unless the send was queued (it must not outlive x)
        return unstage(out, tuple(t.shape), t)

    def _shm_lane(self, shape: tuple[int, ...]) -> _ShmLane:
        if len(self._lanes) > 512:
            self._lanes.clear()
            self._shm.header_of[:] = [None, None]
        fp = self._fingerprint(fr.ALL_REDUCE, wd.FLOAT32.code, shape)
        lane = self._lanes[torch.Size(shape)] = _ShmLane(self._shm, fp, shape)
        return lane

    def _diverged(self, head: bytes, e: same_host.PeerDivergedError) -> base.OpDesyncError:
        """The peer sent TCP bytes while we waited in shared memory: it is in another op,
        waiting on TCP, so our header goes there too (it fails closed as well)."""
        try:
            self._io.send_small(head, memoryview(b""))
            self._io.flush()
        except OSError:
            pass
        if len(e.peeked) >= fr.FIXED_SIZE:
            return self._reader.desync(head, e.peeked)
        return base.OpDesyncError(f"rank {self._rank}: {e}")

    def _swap_same_host(self, head: bytes, payload: Any, nbytes: int) -> memoryview:
        """One frame each way (a RANK_ORDER all-reduce's, a small broadcast's) through shared
        memory; the peer's header must equal ours byte for byte, as on TCP. Returns the peer's
        payload (a view into the segment, read before the next op)."""
        try:
            got = self._shm.exchange(head, payload)
        except same_host.PeerDivergedError as e:
            raise self._diverged(head, e) from None
        if len(got) != len(head) + nbytes or got[: len(head)] != head:
            raise self._reader.desync(head, got)
        return got[len(head) :]

    def _pair_plan(self, shape: tuple[int, ...]) -> _PairPlan:
        if len(self._pairs) > 512:
            self._pairs.clear()
        n = 1
        for d in shape:
            n *= d
        # the frame of the general path (_sum_rank_order: flat payload, fingerprint of the real
        # shape, step 0), so a rank on the general path (say, a bfloat16 rank) meets this one
        head = data_header(fr.ALL_REDUCE, wd.FLOAT32.code, 0, 0, (n,), 0)
        fp = self._fingerprint(fr.ALL_REDUCE, wd.FLOAT32.code, shape)
        plan = _PairPlan(fp, head[fr.FIXED_SIZE :], 4 * n, self._reader)
        self._pairs[torch.Size(shape)] = plan
        return plan

    def _reduce_scatter_ring(
        self, x: np.ndarray, acc: np.ndarray, op: int, seq: int, fp: int
    ) -> None:
        """RING reduce-scatter: afterwards acc[chunk r] holds the (unrounded) full sum of chunk r."""
        size, wire = self._size, self._wire
        bounds = alg.chunk_bounds(x.size, size)
        scratch = self._buffer("scratch", max(hi - lo for lo, hi in bounds), self._wnp)
        f32 = wire.code == wd.FLOAT32.code
        seg = _SEGMENT_BYTES // wire.itemsize
        keep: list[np.ndarray] = []  # encoded sends stay alive until flushed
        for s, (send_c, recv_c) in enumerate(alg.ring_reduce_steps(self._rank, size)):
            lo, hi = bounds[send_c]
            payload = encode_f32((x if s == 0 else acc)[lo:hi], wire)
            keep.append(payload)
            self._io.send([self._header(op, wire.code, seq, fp, (hi - lo,), s), payload])
            rlo, rhi = bounds[recv_c]
            m = rhi - rlo
            done = [0]

            def reduce_upto(nbytes: int, rlo: int = rlo, m: int = m, done: list = done) -> None:
                upto = min(m, nbytes // wire.itemsize)
                if upto - done[0] < seg and upto < m:
                    return
                a, b = done[0], upto
                part = scratch[a:b] if f32 else decode_f32(scratch[a:b], wire)
                np.add(part, x[rlo + a : rlo + b], out=acc[rlo + a : rlo + b])
                done[0] = upto

            head = self._header(op, wire.code, seq, fp, (m,), s)
            self._recv_known(head, memoryview(scratch[:m]), reduce_upto)
            if m == 0:
                continue

    def _all_gather_ring(
        self, acc: np.ndarray, op: int, seq: int, fp: int, first_step: int
    ) -> None:
        """RING all-gather of the owned chunks (each rounded through the wire once, on its owner)."""
        size, wire, r = self._size, self._wire, self._rank
        bounds = alg.chunk_bounds(acc.size, size)
        f32 = wire.code == wd.FLOAT32.code
        carried = acc if f32 else self._buffer("carried", acc.size, self._wnp)
        lo, hi = bounds[r]
        if not f32:
            carried[lo:hi] = encode_f32(acc[lo:hi], wire)
            acc[lo:hi] = decode_f32(carried[lo:hi], wire)
        for s, (send_c, recv_c) in enumerate(alg.ring_gather_steps(r, size)):
            lo, hi = bounds[send_c]
            step = first_step + s
            self._io.send([self._header(op, wire.code, seq, fp, (hi - lo,), step), carried[lo:hi]])
            rlo, rhi = bounds[recv_c]
            head = self._header(op, wire.code, seq, fp, (rhi - rlo,), step)
            self._recv_known(head, memoryview(carried[rlo:rhi]))
            if not f32:
                acc[rlo:rhi] = decode_f32(carried[rlo:rhi], wire)
        self._io.flush()

    def _all_reduce(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        seq = self._begin()
        op, code = fr.ALL_REDUCE, self._wire.code
        fp = self._fingerprint(op, code, shape)
        if (
            alg.choose_all_reduce(x.size * self._wire.itemsize, self._size, self._small)
            == alg.RANK_ORDER
        ):
            return self._guard(self._sum_rank_order, x, op, seq, fp)
        acc = self._output(x.size)
        self._guard(self._reduce_scatter_ring, x, acc, op, seq, fp)
        # The gather receives into chunks the scatter may still be sending from: drain first.
        self._guard(self._io.flush)
        self._guard(self._all_gather_ring, acc, op, seq, fp, self._size - 1)
        return acc

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        lane = self._lanes.get(t.shape) if isinstance(t, torch.Tensor) else None
        if lane is not None and t.dtype is _F32:
            # The same-host decode hot path, inline (each call and torch op costs here: the
            # weight stream before every all-reduce has evicted this code from the caches). A
            # lane exists only for a float32 shape under the small cut-over on a same-host pair,
            # and none once the ring is broken. It swaps the frame `_sum_rank_order` would send
            # (so a general-path peer meets it), written in place: the payload by one tensor copy
            # from `host_tensor` (the one host crossing), the header only when the slot last
            # held another shape, its seq as one word; then published (length, then the swap
            # number: the order `transport.shm` relies on). The peer's header must equal ours
            # byte for byte; the sum is x + peer (= the rank-order sum: float addition is
            # commutative), one tensor add from the peer's frame.
            try:
                self._seq += 1
                pair = self._shm
                c = pair.count = pair.count + 1
                p = c & 1
                x = host_tensor(t, _F32)  # t itself when t is CPU, contiguous, detached
                lane.mine[p].copy_(x)
                mm, words, mine = lane.mm, lane.words, lane.mine_at[p]
                if pair.header_of[p] is not lane:  # else the header there is ours but its seq
                    mm[mine : mine + lane.hlen] = lane.head
                    pair.header_of[p] = lane
                words[lane.seq_word[p]] = self._seq
                w = lane.my_slot[p]
                words[w + 1] = lane.length
                words[w] = c
                w = lane.peer_slot[p]
                if words[w] != c:
                    pair.wait(w, c)
                peer = lane.peer_at[p]
                head, got = mm[mine : mine + lane.hlen], mm[peer : peer + lane.hlen]
                if words[w + 1] != lane.length or got != head:
                    raise self._reader.desync(head, got)
                out = torch.add(x, lane.peer[p])
            except same_host.PeerDivergedError as e:
                self._break(f"{type(e).__name__}: {e}")
                raise self._diverged(lane.mm[mine : mine + lane.hlen], e) from None  # bytes
            except BaseException as e:
                self._break(f"{type(e).__name__}: {e}")
                raise
            return out if x is t else to_caller(out, t)
        if (
            self._pair_max
            and isinstance(t, torch.Tensor)
            and t.dtype is torch.float32
            and t.is_cpu
            and t.numel() <= self._pair_max
        ):
            if self._broken is not None:
                raise base.CommClosedError(f"rank {self._rank}: ring is unusable: {self._broken}")
            try:  # _guard, inlined
                if self._shm is not None:
                    self._shm_lane(tuple(t.shape))
                    return self.all_reduce_sum(t)  # now through its lane
                if t.is_contiguous() and not t.requires_grad:
                    return self._pair_sum(t)
            except BaseException as e:
                self._break(f"{type(e).__name__}: {e}")
                raise
        base.check_tensor(t, "all_reduce_sum", reduce=True)
        x = stage_to_host(t, torch.float32)
        return unstage(self._all_reduce(x, tuple(t.shape)), tuple(t.shape), t)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "reduce_scatter", reduce=True)
        d = base.check_dim(t, dim, "reduce_scatter")
        part = base.check_divisible(t, d, self._size, "reduce_scatter")
        moved = t.movedim(d, 0)
        x = stage_to_host(moved, torch.float32)  # (size_d * rest,) with parts contiguous
        seq = self._begin()
        op, code, r = fr.REDUCE_SCATTER, self._wire.code, self._rank
        fp = fr.fingerprint(op, code, (*t.shape, d))
        rows = part * (x.size // max(t.shape[d], 1)) if t.shape[d] else 0
        if (
            alg.choose_all_reduce(x.size * self._wire.itemsize, self._size, self._small)
            == alg.RANK_ORDER
        ):
            mine = self._guard(self._sum_rank_order, x, op, seq, fp)[
                r * rows : (r + 1) * rows
            ].copy()
        else:
            acc = np.empty(x.size, dtype=np.float32)
            self._guard(self._reduce_scatter_ring, x, acc, op, seq, fp)
            self._io.flush()
            lo, hi = alg.chunk_bounds(x.size, self._size)[r]
            mine = acc[lo:hi]
            if self._wire.code != wd.FLOAT32.code:
                mine = decode_f32(encode_f32(mine, self._wire), self._wire)
            mine = mine.copy()
        shape = (part, *moved.shape[1:])
        return unstage(mine, shape, t).movedim(0, d).contiguous()

    # ----------------------------------------------------------------------------- movement

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "all_gather", reduce=False)
        d = base.check_dim(t, dim, "all_gather")
        wire, payload = encode_tensor(t, self._wire)
        seq = self._begin()
        op = fr.ALL_GATHER
        others = tuple(0 if i == d else s for i, s in enumerate(t.shape))
        fp = fr.fingerprint(op, wire.code, (*others, d))
        blocks = self._guard(self._gather_blocks, wire, payload, tuple(t.shape), d, op, seq, fp)
        parts = [decode_tensor(p, wire, s, t.dtype, t.device) for s, p in blocks]
        return torch.cat(parts, dim=d)

    def _gather_blocks(
        self,
        wire: wd.WireDtype,
        payload: np.ndarray,
        shape: tuple[int, ...],
        d: int,
        op: int,
        seq: int,
        fp: int,
    ) -> list[tuple[tuple[int, ...], np.ndarray]]:
        size, r = self._size, self._rank
        blocks: list[Any] = [None] * size
        blocks[r] = (shape, payload)
        for s in range(size - 1):
            bshape, bpay = blocks[(r - s) % size]
            self._io.send([self._header(op, wire.code, seq, fp, bshape, s), bpay])
            header, got = self._reader.any(op, seq, fp, s)
            src = (r - s - 1) % size
            check_gathered_shape(header, wire.code, shape, d, src)
            blocks[src] = (header.shape, got.view(np_dtype(wire)))
        self._io.flush()
        return blocks

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        base.check_tensor(t, "broadcast", reduce=False)
        base.check_src(src, self._size)
        wire, payload = encode_tensor(t, self._wire)
        seq = self._begin()
        shape = tuple(t.shape)
        fp = self._fingerprint(fr.BROADCAST, wire.code, (*shape, src))
        got = self._guard(self._broadcast, wire, payload, shape, src, seq, fp)
        return decode_tensor(got, wire, shape, t.dtype, t.device)

    def _broadcast(
        self,
        wire: wd.WireDtype,
        payload: np.ndarray,
        shape: tuple[int, ...],
        src: int,
        seq: int,
        fp: int,
    ) -> np.ndarray:
        """A chain from the root, r -> r+1. Over TCP every rank first sends its right neighbour a
        header-only claim frame (fingerprint of shape, dtype and root) and checks its left one's,
        so ranks that disagree on the root (or shape) fail with OpDesyncError on both sides of the
        disagreement instead of each returning its own tensor. A receiver sends its claim on
        entry, so the root rarely waits for it."""
        hop = (self._rank - src) % self._size  # 0 at the root
        if self._shm is not None and payload.nbytes <= self._small:  # N = 2 on one host
            # one swap: both post the frame of step 0 (the receiver its own, unused payload)
            head = self._header(fr.BROADCAST, wire.code, seq, fp, shape, 0)
            got = self._swap_same_host(head, payload, payload.nbytes)
            return payload if hop == 0 else np.frombuffer(got, payload.dtype).copy()
        claim = self._header(fr.BROADCAST, wire.code, seq, fp, (0,), CLAIM_STEP)
        try:
            if hop == 0:
                head = self._header(fr.BROADCAST, wire.code, seq, fp, shape, 0)
                self._io.send([claim, head, payload])
                self._reader.known_small(claim, 0, np.uint8)
                self._io.flush()
                return payload
            self._io.send([claim])
            self._reader.known_small(claim, 0, np.uint8)
            head = self._header(fr.BROADCAST, wire.code, seq, fp, shape, hop - 1)
            if payload.nbytes <= self._small:  # header and payload in one receive
                payload = self._reader.known_small(head, payload.nbytes, payload.dtype)
            else:
                payload = np.empty(payload.size, dtype=payload.dtype)
                self._recv_known(head, memoryview(payload))
            if hop < self._size - 1:
                self._io.send([self._header(fr.BROADCAST, wire.code, seq, fp, shape, hop), payload])
            self._io.flush()
            return payload
        except base.OpDesyncError:
            # the right neighbour may be waiting for our payload: an abort frame fails it too
            try:
                self._io.send([self._header(fr.BROADCAST, wire.code, seq, fp, (0,), ABORT_STEP)])
                self._io.flush()
            except OSError:
                pass
            raise

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = base.check_parts(parts, self._size, "all_to_all")
        encoded = [encode_tensor(p, self._wire) for p in parts]
        wire = encoded[0][0]
        seq = self._begin()
        fp = fr.fingerprint(fr.ALL_TO_ALL, wire.code, (self._size,))
        got = self._guard(
            self._all_to_all,
            wire,
            [(tuple(p.shape), e[1]) for p, e in zip(parts, encoded)],
            seq,
            fp,
        )
        like = parts[0]
        return [decode_tensor(p, wire, s, like.dtype, like.device) for s, p in got]

    def _all_to_all(
        self, wire: wd.WireDtype, items: list[tuple[tuple[int, ...], np.ndarray]], seq: int, fp: int
    ) -> list:
        """Store-and-forward around the ring: at step s, rank r forwards the N-s items that rank
        r-s+1 addressed to ranks r+1 .. r+N-s, nearest first, and keeps the one addressed to it."""
        size, r = self._size, self._rank
        out: list[Any] = [None] * size
        out[r] = items[r]
        held = [items[(r + k) % size] for k in range(1, size)]  # addressed to r+1, r+2, ...
        for s in range(1, size):
            for shape, payload in held:
                self._io.send([self._header(fr.ALL_TO_ALL, wire.code, seq, fp, shape, s), payload])
            incoming = []
            for _ in range(size - s):
                header, got = self._reader.any(fr.ALL_TO_ALL, seq, fp, s)
                if header.dtype != wire.code:
                    raise base.RaggedPartsError(
                        f"all_to_all: rank {(r - s) % size} sent another dtype"
                    )
                incoming.append((header.shape, got.view(np_dtype(wire))))
            out[(r - s) % size] = incoming[0]
            self._io.flush()
            held = incoming[1:]
        return out

    def barrier(self) -> None:
        seq = self._begin()
        one = np.zeros(1, dtype=np.float32)
        fp = self._fingerprint(fr.BARRIER, self._wire.code, (1,))
        self._guard(self._sum_rank_order, one, fr.BARRIER, seq, fp)

    def close(self) -> None:
        if self._broken is None:
            self._break("closed")
        self._io.close()
        if self._shm is not None:
            self._shm.close()
        self._left.close()
        self._right.close()
