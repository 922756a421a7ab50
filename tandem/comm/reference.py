"""The conformance oracle: every collective computed in one process, in each algorithm's own order.

Two layers:
- pure functions (`all_reduce_sum`, `all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`)
  that take every rank's input and return every rank's output, mirroring the reduction order of
  the algorithm a real backend runs (see `algorithms.py`: RANK_ORDER or RING) and the rounding
  through the wire dtype each hop applies (identity for the float32 wire);
- `ReferenceCommunicator`, a real `Communicator` for N threads of one process (one per rank) that
  meet on a shared board and evaluate those functions: the in-process backend tests and the
  tensor-parallel equivalence tests drive.

A network backend is correct iff it returns, on every rank, exactly these bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tandem.comm import algorithms as alg
from tandem.comm import base
from tandem.comm.staging import decode_tensor, encode_tensor, quantize, stage_to_host, unstage
from tandem.wire import dtypes as wd

DEFAULT_TIMEOUT_S = 60.0


def _q_tensor(t: torch.Tensor, wire: wd.WireDtype) -> torch.Tensor:
    """t as a receiver sees it: through the wire and back (floats as float32, integers exact)."""
    w, payload = encode_tensor(t, wire)
    return decode_tensor(payload.copy(), w, tuple(t.shape))


def sum_rank_order(xs: Sequence[np.ndarray], wire: wd.WireDtype) -> np.ndarray:
    """q(((q(x_0) + q(x_1)) + q(x_2)) + ...): the RANK_ORDER all-reduce of flat float32 arrays."""
    acc = quantize(xs[0], wire).copy()
    for x in xs[1:]:
        np.add(acc, quantize(x, wire), out=acc)
    return quantize(acc, wire)


def sum_ring_chunks(
    xs: Sequence[np.ndarray], wire: wd.WireDtype, bounds: list[tuple[int, int]], cols: int = 0
) -> np.ndarray:
    """The RING all-reduce of float32 arrays: chunk c (flat ranges `bounds`, or with `cols` the
    column ranges `bounds` of every row of `cols` columns) is summed in `algorithms.ring_order`,
    starting at rank c+1, each forwarded partial rounded through the wire, the finished chunk
    rounded once more."""
    n = len(xs)
    cols = cols or xs[0].size
    grids = [x.reshape(-1, cols) if cols else x.reshape(1, 0) for x in xs]
    out = np.empty_like(xs[0])
    grid = out.reshape(grids[0].shape)
    for c, (lo, hi) in enumerate(bounds):
        first, *rest = alg.ring_order(c, n)
        acc = grids[first][:, lo:hi].copy()
        for k in rest:
            acc = quantize(acc, wire) + grids[k][:, lo:hi]
        grid[:, lo:hi] = quantize(acc, wire)
    return out


def _flat_sum(
    xs: Sequence[np.ndarray], wire: wd.WireDtype, algorithm: str, bounds: list[tuple[int, int]]
) -> np.ndarray:
    if algorithm == alg.RANK_ORDER:
        return sum_rank_order(xs, wire)
    return sum_ring_chunks(xs, wire, bounds)


def _ring_all_reduce(
    xs: Sequence[np.ndarray], wire: wd.WireDtype, algorithm: str, shape: tuple[int, ...]
) -> np.ndarray:
    """The ring's all-reduce (`algorithms`): column chunks of the last dimension, and RANK_ORDER
    on the float32 wire with more than two ranks summing each in the same ring order."""
    if algorithm == alg.RANK_ORDER and (len(xs) == 2 or wire.code != wd.FLOAT32.code):
        return sum_rank_order(xs, wire)
    cols = shape[-1] if shape else 1
    return sum_ring_chunks(xs, wire, alg.column_bounds(shape, len(xs)), cols)


def all_reduce_sum(
    inputs: Sequence[torch.Tensor],
    *,
    wire_dtype: str = "float32",
    algorithm: str | None = None,
    small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
) -> list[torch.Tensor]:
    """Every rank's all-reduce output: `algorithm` None is the ring's (by size, column chunks,
    `_ring_all_reduce`); RANK_ORDER (the star's, gloo's) or RING forces that order, RING on
    flat chunks."""
    wire = wd.negotiable(wire_dtype)
    ts = [base.check_tensor(t, "all_reduce_sum", reduce=True) for t in inputs]
    base.check_same_shape([tuple(t.shape) for t in ts], "all_reduce_sum")
    if len(ts) == 1:
        return [ts[0]]
    n = ts[0].numel()
    algo = algorithm or alg.choose_all_reduce(n * wire.itemsize, len(ts), small_max_bytes)
    xs = [stage_to_host(t, torch.float32) for t in ts]
    if algorithm is None:
        total = _ring_all_reduce(xs, wire, algo, tuple(ts[0].shape))
    else:
        total = _flat_sum(xs, wire, algo, alg.chunk_bounds(n, len(ts)))
    return [unstage(total.copy(), tuple(t.shape), t) for t in ts]


def reduce_scatter(
    inputs: Sequence[torch.Tensor],
    dim: int = 0,
    *,
    wire_dtype: str = "float32",
    algorithm: str | None = None,
    small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
) -> list[torch.Tensor]:
    """Rank r's part r of the all-reduce sum along `dim`. The RING order cuts chunks at the
    `dim` parts (for a 1-D tensor these are exactly the all-reduce's chunks, so the identity
    all_reduce_sum == all_gather . reduce_scatter holds bit for bit)."""
    wire = wd.negotiable(wire_dtype)
    ts = [base.check_tensor(t, "reduce_scatter", reduce=True) for t in inputs]
    size = len(ts)
    d = base.check_dim(ts[0], dim, "reduce_scatter")
    base.check_same_shape([tuple(t.shape) for t in ts], "reduce_scatter")
    part = base.check_divisible(ts[0], d, size, "reduce_scatter")
    if size == 1:
        return [ts[0]]
    moved_shape = (ts[0].shape[d], *[s for i, s in enumerate(ts[0].shape) if i != d])
    xs = [stage_to_host(t.movedim(d, 0), torch.float32) for t in ts]
    n = xs[0].size
    algo = algorithm or alg.choose_all_reduce(n * wire.itemsize, size, small_max_bytes)
    if algorithm is None:  # the ring's: flat chunks (the parts), in their ring order
        total = _ring_all_reduce(xs, wire, algo, (n,)).reshape(moved_shape)
    else:
        total = _flat_sum(xs, wire, algo, alg.chunk_bounds(n, size)).reshape(moved_shape)
    outs = []
    for r, t in enumerate(ts):
        mine = np.ascontiguousarray(total[r * part : (r + 1) * part])
        shape = (part, *moved_shape[1:])
        outs.append(unstage(mine.reshape(-1), shape, t).movedim(0, d).contiguous())
    return outs


def all_gather(
    inputs: Sequence[torch.Tensor], dim: int = 0, *, wire_dtype: str = "float32"
) -> list[torch.Tensor]:
    """The rank-ordered concatenation along `dim` (each part seen through the wire), per rank."""
    wire = wd.negotiable(wire_dtype)
    ts = [base.check_tensor(t, "all_gather", reduce=False) for t in inputs]
    d = base.check_dim(ts[0], dim, "all_gather")
    base.check_gather_shapes([tuple(t.shape) for t in ts], d, "all_gather")
    if len(ts) == 1:
        return [ts[0]]
    whole = torch.cat([_q_tensor(t, wire) for t in ts], dim=d)
    return [whole.to(device=t.device, dtype=t.dtype) for t in ts]


def all_to_all(
    inputs: Sequence[Sequence[torch.Tensor]], *, wire_dtype: str = "float32"
) -> list[list[torch.Tensor]]:
    """outputs[r][j] = inputs[j][r] seen through the wire, in rank r's parts' dtype and device."""
    wire = wd.negotiable(wire_dtype)
    size = len(inputs)
    parts = [base.check_parts(p, size, "all_to_all") for p in inputs]
    if size == 1:
        return [list(parts[0])]
    outs = []
    for r in range(size):
        like = parts[r][0]
        outs.append([_q_tensor(parts[j][r], wire).to(like.device, like.dtype) for j in range(size)])
    return outs


def broadcast(
    inputs: Sequence[torch.Tensor], src: int = 0, *, wire_dtype: str = "float32"
) -> list[torch.Tensor]:
    """Rank src's tensor (seen through the wire) on every rank, in each rank's dtype and device."""
    wire = wd.negotiable(wire_dtype)
    ts = [base.check_tensor(t, "broadcast", reduce=False) for t in inputs]
    base.check_src(src, len(ts))
    base.check_same_shape([tuple(t.shape) for t in ts], "broadcast")
    if len(ts) == 1:
        return [ts[0]]
    seen = _q_tensor(ts[src], wire)
    return [seen.to(device=t.device, dtype=t.dtype) for t in ts]


class _Board:
    """Where N rank threads meet: each posts one item, waits for all, and reads all N."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.slots: list[Any] = [None] * world_size
        self.barrier = threading.Barrier(world_size)
        self.timeout = timeout

    def _wait(self, rank: int, what: str) -> None:
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise base.CommTimeoutError(
                f"rank {rank}: not every rank reached {what} within {self.timeout:g} s"
            ) from None

    def exchange(self, rank: int, item: Any, what: str) -> list[Any]:
        self.slots[rank] = item
        self._wait(rank, what)
        snapshot = list(self.slots)
        self._wait(rank, what)
        return snapshot


class ReferenceCommunicator:
    """Rank `rank` of an in-process group; create a whole group with `ReferenceCommunicator.group`.

    `algorithm` "ring" (default) mirrors RingCommunicator's order choice by size; "star" mirrors
    the star (always RANK_ORDER). `wire_dtype` and `small_max_bytes` must match the backend mirrored.
    """

    def __init__(
        self, rank: int, board: _Board, *, wire_dtype: str, algorithm: str, small_max_bytes: int
    ) -> None:
        self._rank, self._board = rank, board
        self._size = len(board.slots)
        self._wire = wire_dtype
        self._algo = alg.RANK_ORDER if algorithm == "star" else None
        self._small = small_max_bytes
        self._seq = 0
        self._closed = False

    @classmethod
    def group(
        cls,
        world_size: int,
        *,
        wire_dtype: str = "float32",
        algorithm: str = "ring",
        small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> list[ReferenceCommunicator]:
        """One communicator per rank, sharing one board; drive each from its own thread."""
        if algorithm not in ("ring", "star"):
            raise ValueError(f"algorithm must be 'ring' or 'star', got {algorithm!r}")
        wd.negotiable(wire_dtype)
        board = _Board(world_size, timeout)
        kw = dict(wire_dtype=wire_dtype, algorithm=algorithm, small_max_bytes=small_max_bytes)
        return [cls(r, board, **kw) for r in range(world_size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def _meet(self, op: str, item: Any) -> list[Any]:
        if self._closed:
            raise base.CommClosedError(f"rank {self._rank}: communicator is closed")
        self._seq += 1
        posts = self._board.exchange(self._rank, (op, self._seq, item), op)
        for r, (other_op, other_seq, _) in enumerate(posts):
            if (other_op, other_seq) != (op, self._seq):
                raise base.OpDesyncError(
                    f"rank {self._rank} called {op} #{self._seq} while rank {r} called "
                    f"{other_op} #{other_seq}"
                )
        return [p[2] for p in posts]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        base.check_tensor(t, "all_reduce_sum", reduce=True)
        if self._size == 1:
            return t
        ins = self._meet("all_reduce_sum", t)
        kw = dict(wire_dtype=self._wire, algorithm=self._algo, small_max_bytes=self._small)
        return all_reduce_sum(ins, **kw)[self._rank]

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "reduce_scatter", reduce=True)
        d = base.check_dim(t, dim, "reduce_scatter")
        base.check_divisible(t, d, self._size, "reduce_scatter")
        if self._size == 1:
            return t
        ins = self._meet("reduce_scatter", t)
        kw = dict(wire_dtype=self._wire, algorithm=self._algo, small_max_bytes=self._small)
        return reduce_scatter(ins, d, **kw)[self._rank]

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "all_gather", reduce=False)
        d = base.check_dim(t, dim, "all_gather")
        if self._size == 1:
            return t
        return all_gather(self._meet("all_gather", t), d, wire_dtype=self._wire)[self._rank]

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = base.check_parts(parts, self._size, "all_to_all")
        if self._size == 1:
            return list(parts)
        return all_to_all(self._meet("all_to_all", parts), wire_dtype=self._wire)[self._rank]

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        base.check_tensor(t, "broadcast", reduce=False)
        base.check_src(src, self._size)
        if self._size == 1:
            return t
        ins = self._meet(f"broadcast(src={src})", t)
        return broadcast(ins, src, wire_dtype=self._wire)[self._rank]

    def barrier(self) -> None:
        if self._size > 1:
            self._meet("barrier", None)

    def close(self) -> None:
        self._closed = True


def run_ranks(comms: Sequence[Any], fn: Callable[[Any], Any], timeout: float = 120.0) -> list[Any]:
    """fn(comm) on one thread per rank; every rank's return value, or the first rank's exception."""
    results: list[Any] = [None] * len(comms)
    errors: list[BaseException | None] = [None] * len(comms)

    def body(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as e:  # handed to the caller below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(comms))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
        if th.is_alive():
            raise base.CommTimeoutError(f"a rank thread did not finish within {timeout:g} s")
    for e in errors:
        if e is not None:
            raise e
    return results
