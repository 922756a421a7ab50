"""The ring's general road: every op, any N, any wire dtype, over the TCP link (`ring_link`).

All-reduce (and reduce-scatter) pick their algorithm from (wire bytes, N) alone, so every rank
agrees (`algorithms.choose_all_reduce`):
- RANK_ORDER, small tensors: a ring all-gather of whole tensors (N-1 hops; for N = 2 a single
  exchange), then every rank sums all N in rank order: one hop of latency at N = 2.
- RING, large tensors: reduce-scatter then all-gather over N chunks (each rank sends 2(N-1)/N of
  the tensor); arriving segments are reduced while later bytes are still on the wire.
An all-reduce's chunks are column slices of the last dimension (`algorithms.column_bounds`): the
tensor is copied chunk-major (`_ChunkMajor`: chunk c's columns of every row, one after another)
so each chunk travels as one contiguous run, and on the float32 wire RANK_ORDER sums each column
chunk in the ring's order for it: both give an element the same sum whatever the tensor's rows.
Every rank ends with bit-identical values equal to `reference` for the same algorithm. At N = 2
on one host the small whole-tensor exchanges (RANK_ORDER's, a small broadcast's) go through
`same_host` (`ring_shm.SameHostRoad`) instead of TCP: the same frames, the same checks.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from tandem.comm import algorithms as alg
from tandem.comm import base
from tandem.comm.framing import ABORT_STEP, CLAIM_STEP, check_gathered_shape
from tandem.comm.moves import StagedMoves
from tandem.comm.ring_link import RingLink
from tandem.comm.staging import (
    decode_f32,
    encode_f32,
    np_dtype,
    stage_to_host,
    unstage,
)
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

_SEGMENT_BYTES = 256 * 1024  # reduce arriving data in cache-sized pieces


class _ChunkMajor:
    """A flat tensor of `shape` (rows x cols, cols its last dimension) against its column chunks
    `algorithms.column_bounds`: `flat` are the chunks' ranges once the tensor is laid out
    chunk-major (chunk 0's columns of every row, then chunk 1's, ...); `is_flat` when that layout
    is the tensor's own (one row, or one column chunk's worth)."""

    def __init__(self, shape: tuple[int, ...], n: int, world_size: int) -> None:
        self.size = world_size
        self.cols = shape[-1] if shape else 1
        self.rows = n // self.cols if self.cols else 0
        self.bounds = alg.column_bounds(shape, world_size)
        self.flat, at = [], 0
        for lo, hi in self.bounds:
            self.flat.append((at, at + self.rows * (hi - lo)))
            at += self.rows * (hi - lo)
        self.is_flat = self.rows <= 1

    def _parts(self, flat: np.ndarray, grid: np.ndarray):
        """(chunk-major run, the same elements as a (rows, width) view of the row-major grid)."""
        for (lo, hi), (a, b) in zip(self.bounds, self.flat):
            yield flat[a:b].reshape(self.rows, hi - lo), grid[:, lo:hi]

    def to_chunk_major(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.is_flat:
            return x
        for run, cols in self._parts(out, x.reshape(self.rows, self.cols)):
            run[...] = cols
        return out

    def from_chunk_major(self, acc: np.ndarray, out: np.ndarray) -> np.ndarray:
        for run, cols in self._parts(acc, out.reshape(self.rows, self.cols)):
            cols[...] = run
        return out

    def sum_in_ring_order(self, xs: list[np.ndarray]) -> np.ndarray:
        """Every rank's float32 values (row-major) summed per column chunk c in the ring's order
        for c (`algorithms.ring_order`): what the RING all-reduce gives on the float32 wire."""
        grids = [x.reshape(max(self.rows, 1), self.cols) for x in xs]
        out = np.empty(xs[0].size, dtype=np.float32)
        grid = out.reshape(max(self.rows, 1), self.cols)
        for c, (lo, hi) in enumerate(self.bounds):
            first, second, *rest = alg.ring_order(c, self.size)
            acc = grid[:, lo:hi]
            np.add(grids[first][:, lo:hi], grids[second][:, lo:hi], out=acc)
            for j in rest:
                np.add(acc, grids[j][:, lo:hi], out=acc)
        return out


class TcpRing(StagedMoves):
    """The general algorithms of one rank over `link`; `same_host` (or None) carries the small
    whole-tensor exchanges of an N = 2 pair on one host. The movement ops' envelope (check,
    encode, number, fingerprint, decode) is `moves.StagedMoves`'."""

    def __init__(self, link: RingLink, same_host: Any = None) -> None:
        self.link = link
        self.same_host = same_host
        self._wire, self._size = link.wire, link.size
        self._begin, self._run, self._fingerprint = link.begin, link.guard, link.fingerprint
        self._buffers: dict[str, np.ndarray] = {}
        self._spare: np.ndarray | None = None

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

    # ----------------------------------------------------------------------------- all-reduce

    def sum_rank_order(
        self, x: np.ndarray, op: int, seq: int, fp: int, cols: _ChunkMajor | None = None
    ) -> np.ndarray:
        """RANK_ORDER: ring all-gather of whole wire payloads, then q(sum in rank order); with
        `cols` (float32 wire) each column chunk summed in its ring order instead."""
        link = self.link
        n, size, r, wire = x.size, link.size, link.rank, link.wire
        blocks: list[Any] = [None] * size
        blocks[r] = encode_f32(x, wire)
        hops = size - 1
        if self.same_host is not None and n * wire.itemsize <= link.small:  # N = 2, one host
            head = link.header(op, wire.code, seq, fp, (n,), 0)
            got = self.same_host.swap(head, blocks[r], n * wire.itemsize)
            blocks[1 - r], hops = np.frombuffer(got, link.wnp), 0
        for s in range(hops):
            head = link.header(op, wire.code, seq, fp, (n,), s)
            link.io.send([head, blocks[(r - s) % size]])
            blocks[(r - s - 1) % size] = link.reader.known_small(head, n * wire.itemsize, link.wnp)
        link.io.flush()
        if cols is not None:
            return cols.sum_in_ring_order([decode_f32(b, wire) for b in blocks])
        acc = np.add(decode_f32(blocks[0], wire), decode_f32(blocks[1], wire))
        for j in range(2, size):
            np.add(acc, decode_f32(blocks[j], wire), out=acc)
        if wire.code != wd.FLOAT32.code:
            acc = decode_f32(encode_f32(acc, wire), wire)
        return acc

    def _reduce_scatter_ring(
        self, x: np.ndarray, acc: np.ndarray, op: int, seq: int, fp: int, bounds: list
    ) -> None:
        """RING reduce-scatter over the flat chunks `bounds`: afterwards acc[chunk r] holds the
        (unrounded) full sum of chunk r."""
        link = self.link
        size, wire = link.size, link.wire
        scratch = self._buffer("scratch", max(hi - lo for lo, hi in bounds), link.wnp)
        f32 = wire.code == wd.FLOAT32.code
        seg = _SEGMENT_BYTES // wire.itemsize
        keep: list[np.ndarray] = []  # encoded sends stay alive until flushed
        for s, (send_c, recv_c) in enumerate(alg.ring_reduce_steps(link.rank, size)):
            lo, hi = bounds[send_c]
            payload = encode_f32((x if s == 0 else acc)[lo:hi], wire)
            keep.append(payload)
            link.io.send([link.header(op, wire.code, seq, fp, (hi - lo,), s), payload])
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

            head = link.header(op, wire.code, seq, fp, (m,), s)
            link.reader.known(head, memoryview(scratch[:m]), reduce_upto)
            if m == 0:
                continue

    def _all_gather_ring(
        self, acc: np.ndarray, op: int, seq: int, fp: int, first_step: int, bounds: list
    ) -> None:
        """RING all-gather of the owned flat chunks `bounds` (each rounded through the wire once,
        on its owner)."""
        link = self.link
        size, wire, r = link.size, link.wire, link.rank
        f32 = wire.code == wd.FLOAT32.code
        carried = acc if f32 else self._buffer("carried", acc.size, link.wnp)
        lo, hi = bounds[r]
        if not f32:
            carried[lo:hi] = encode_f32(acc[lo:hi], wire)
            acc[lo:hi] = decode_f32(carried[lo:hi], wire)
        for s, (send_c, recv_c) in enumerate(alg.ring_gather_steps(r, size)):
            lo, hi = bounds[send_c]
            step = first_step + s
            link.io.send([link.header(op, wire.code, seq, fp, (hi - lo,), step), carried[lo:hi]])
            rlo, rhi = bounds[recv_c]
            head = link.header(op, wire.code, seq, fp, (rhi - rlo,), step)
            link.reader.known(head, memoryview(carried[rlo:rhi]))
            if not f32:
                acc[rlo:rhi] = decode_f32(carried[rlo:rhi], wire)
        link.io.flush()

    def _ordered(self) -> bool:
        """Whether RANK_ORDER sums in the ring's order (`algorithms`): float32 wire, N > 2."""
        return self.link.size > 2 and self.link.wire.code == wd.FLOAT32.code

    def _all_reduce(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        link = self.link
        seq = link.begin()
        op, code = fr.ALL_REDUCE, link.wire.code
        fp = link.fingerprint(op, code, shape)
        cols = _ChunkMajor(shape, x.size, link.size)
        if (
            alg.choose_all_reduce(x.size * link.wire.itemsize, link.size, link.small)
            == alg.RANK_ORDER
        ):
            return link.guard(
                self.sum_rank_order, x, op, seq, fp, cols if self._ordered() else None
            )
        xc = cols.to_chunk_major(x, self._buffer("chunk_major_in", x.size, np.float32))
        acc = (
            self._output(x.size)
            if cols.is_flat
            else self._buffer("chunk_major", x.size, np.float32)
        )
        link.guard(self._reduce_scatter_ring, xc, acc, op, seq, fp, cols.flat)
        # The gather receives into chunks the scatter may still be sending from: drain first.
        link.guard(link.io.flush)
        link.guard(self._all_gather_ring, acc, op, seq, fp, link.size - 1, cols.flat)
        return acc if cols.is_flat else cols.from_chunk_major(acc, self._output(x.size))

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        base.check_tensor(t, "all_reduce_sum", reduce=True)
        x = stage_to_host(t, torch.float32)
        return unstage(self._all_reduce(x, tuple(t.shape)), tuple(t.shape), t)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        link = self.link
        base.check_tensor(t, "reduce_scatter", reduce=True)
        d = base.check_dim(t, dim, "reduce_scatter")
        part = base.check_divisible(t, d, link.size, "reduce_scatter")
        moved = t.movedim(d, 0)
        x = stage_to_host(moved, torch.float32)  # (size_d * rest,) with parts contiguous
        seq = link.begin()
        op, code, r = fr.REDUCE_SCATTER, link.wire.code, link.rank
        fp = fr.fingerprint(op, code, (*t.shape, d))
        rows = part * (x.size // max(t.shape[d], 1)) if t.shape[d] else 0
        if (
            alg.choose_all_reduce(x.size * link.wire.itemsize, link.size, link.small)
            == alg.RANK_ORDER
        ):
            cols = _ChunkMajor((x.size,), x.size, link.size) if self._ordered() else None
            total = link.guard(self.sum_rank_order, x, op, seq, fp, cols)
            mine = total[r * rows : (r + 1) * rows].copy()
        else:
            acc = np.empty(x.size, dtype=np.float32)
            bounds = alg.chunk_bounds(x.size, link.size)
            link.guard(self._reduce_scatter_ring, x, acc, op, seq, fp, bounds)
            link.io.flush()
            lo, hi = bounds[r]
            mine = acc[lo:hi]
            if link.wire.code != wd.FLOAT32.code:
                mine = decode_f32(encode_f32(mine, link.wire), link.wire)
            mine = mine.copy()
        shape = (part, *moved.shape[1:])
        return unstage(mine, shape, t).movedim(0, d).contiguous()

    # ----------------------------------------------------------------------------- movement

    def _gather_blocks(
        self,
        wire: wd.WireDtype,
        payload: np.ndarray,
        shape: tuple[int, ...],
        d: int,
        seq: int,
        fp: int,
    ) -> list[tuple[tuple[int, ...], np.ndarray]]:
        link, op = self.link, fr.ALL_GATHER
        size, r = link.size, link.rank
        blocks: list[Any] = [None] * size
        blocks[r] = (shape, payload)
        for s in range(size - 1):
            bshape, bpay = blocks[(r - s) % size]
            link.io.send([link.header(op, wire.code, seq, fp, bshape, s), bpay])
            header, got = link.reader.any(op, seq, fp, s)
            src = (r - s - 1) % size
            check_gathered_shape(header, wire.code, shape, d, src)
            blocks[src] = (header.shape, got.view(np_dtype(wire)))
        link.io.flush()
        return blocks

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
        link = self.link
        hop = (link.rank - src) % link.size  # 0 at the root
        if self.same_host is not None and payload.nbytes <= link.small:  # N = 2 on one host
            # one swap: both post the frame of step 0 (the receiver its own, unused payload)
            head = link.header(fr.BROADCAST, wire.code, seq, fp, shape, 0)
            got = self.same_host.swap(head, payload, payload.nbytes)
            return payload if hop == 0 else np.frombuffer(got, payload.dtype).copy()
        claim = link.header(fr.BROADCAST, wire.code, seq, fp, (0,), CLAIM_STEP)
        try:
            if hop == 0:
                head = link.header(fr.BROADCAST, wire.code, seq, fp, shape, 0)
                link.io.send([claim, head, payload])
                link.reader.known_small(claim, 0, np.uint8)
                link.io.flush()
                return payload
            link.io.send([claim])
            link.reader.known_small(claim, 0, np.uint8)
            head = link.header(fr.BROADCAST, wire.code, seq, fp, shape, hop - 1)
            if payload.nbytes <= link.small:  # header and payload in one receive
                payload = link.reader.known_small(head, payload.nbytes, payload.dtype)
            else:
                payload = np.empty(payload.size, dtype=payload.dtype)
                link.reader.known(head, memoryview(payload))
            if hop < link.size - 1:
                link.io.send([link.header(fr.BROADCAST, wire.code, seq, fp, shape, hop), payload])
            link.io.flush()
            return payload
        except base.OpDesyncError:
            # the right neighbour may be waiting for our payload: an abort frame fails it too
            try:
                link.io.send([link.header(fr.BROADCAST, wire.code, seq, fp, (0,), ABORT_STEP)])
                link.io.flush()
            except OSError:
                pass
            raise

    def _all_to_all(
        self, wire: wd.WireDtype, items: list[tuple[tuple[int, ...], np.ndarray]], seq: int, fp: int
    ) -> list:
        """Store-and-forward around the ring: at step s, rank r forwards the N-s items that rank
        r-s+1 addressed to ranks r+1 .. r+N-s, nearest first, and keeps the one addressed to it."""
        link = self.link
        size, r = link.size, link.rank
        out: list[Any] = [None] * size
        out[r] = items[r]
        held = [items[(r + k) % size] for k in range(1, size)]  # addressed to r+1, r+2, ...
        for s in range(1, size):
            for shape, payload in held:
                link.io.send([link.header(fr.ALL_TO_ALL, wire.code, seq, fp, shape, s), payload])
            incoming = []
            for _ in range(size - s):
                header, got = link.reader.any(fr.ALL_TO_ALL, seq, fp, s)
                if header.dtype != wire.code:
                    raise base.RaggedPartsError(
                        f"all_to_all: rank {(r - s) % size} sent another dtype"
                    )
                incoming.append((header.shape, got.view(np_dtype(wire))))
            out[(r - s) % size] = incoming[0]
            link.io.flush()
            held = incoming[1:]
        return out

    def barrier(self) -> None:
        link = self.link
        seq = link.begin()
        one = np.zeros(1, dtype=np.float32)
        fp = link.fingerprint(fr.BARRIER, link.wire.code, (1,))
        link.guard(self.sum_rank_order, one, fr.BARRIER, seq, fp)
