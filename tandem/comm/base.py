"""The Communicator contract every backend implements (DESIGN.md, "The contracts").

Input tensors may live on any device in any float dtype; outputs come back on the caller's device in
the caller's dtype. Unless the backend is a same-vendor device library, the reduction runs on the
host in float32 over the negotiated wire dtype. World size 1 short-circuits every collective.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Communicator(Protocol):
    """A process group of `world_size` ranks; this object is rank `rank` of it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of every rank's `t` (same shape on all ranks); bit-identical on all ranks."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Rank-ordered concatenation along `dim`; parts may differ in size along `dim` only."""
        ...

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The all-reduce sum, split equally along `dim`; rank r keeps part r. Indivisible fails."""
        ...

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank r sends parts[j] to rank j and returns what every rank j sent it, in rank order."""
        ...

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank returns rank `src`'s tensor (shape and dtype must agree on all ranks)."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Typed errors every backend raises, and the validation each collective runs before any exchange.
# ---------------------------------------------------------------------------------------------

REDUCIBLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
# Non-reducing collectives (gather, all-to-all, broadcast) also carry integer ids exactly.
MOVABLE_DTYPES: tuple[torch.dtype, ...] = REDUCIBLE_DTYPES + (torch.int64, torch.int32, torch.uint8)


class CommError(RuntimeError):
    """Base of every collective failure."""


class UnsupportedDtypeError(CommError, TypeError):
    """A tensor dtype the op does not take (e.g. float64 or an integer tensor into a sum)."""


class RaggedPartsError(CommError, ValueError):
    """Parts whose shapes disagree where the op needs them equal."""


class IndivisibleError(CommError, ValueError):
    """A size the op must split equally across ranks but cannot."""


class OpDesyncError(CommError):
    """Ranks called different collectives (or the same one on different shapes) at the same step."""


class CommClosedError(CommError):
    """The communicator was closed, or broken by an earlier failure, and refuses further ops."""


def check_tensor(t: object, op: str, *, reduce: bool) -> torch.Tensor:
    """`t` itself if it is a tensor whose dtype `op` takes; otherwise UnsupportedDtypeError."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedDtypeError(f"{op} takes a torch.Tensor, got {type(t).__name__}")
    allowed = REDUCIBLE_DTYPES if reduce else MOVABLE_DTYPES
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise UnsupportedDtypeError(
            f"{op} does not take dtype {str(t.dtype).removeprefix('torch.')}; it takes {names}"
        )
    return t


def check_dim(t: torch.Tensor, dim: int, op: str) -> int:
    """`dim` normalised to [0, t.ndim); a 0-d tensor or an out-of-range dim raises RaggedPartsError."""
    if t.ndim == 0:
        raise RaggedPartsError(f"{op} needs a tensor with at least one dimension, got a scalar")
    if not -t.ndim <= dim < t.ndim:
        raise RaggedPartsError(f"{op}: dim {dim} is out of range for shape {tuple(t.shape)}")
    return dim % t.ndim


def check_divisible(t: torch.Tensor, dim: int, world_size: int, op: str) -> int:
    """The per-rank part size t.shape[dim] / world_size; IndivisibleError when it is not whole."""
    size = t.shape[dim]
    if size % world_size:
        raise IndivisibleError(
            f"{op}: dim {dim} of shape {tuple(t.shape)} has size {size}, which {world_size} "
            f"ranks cannot split equally"
        )
    return size // world_size


def check_parts(parts: object, world_size: int, op: str) -> list[torch.Tensor]:
    """An all_to_all part list: exactly `world_size` tensors of one movable dtype on one device."""
    if not isinstance(parts, (list, tuple)):
        raise RaggedPartsError(f"{op} takes a list of {world_size} tensors, got {type(parts)}")
    if len(parts) != world_size:
        raise RaggedPartsError(f"{op} takes one part per rank ({world_size}), got {len(parts)}")
    out = [check_tensor(p, op, reduce=False) for p in parts]
    first = out[0]
    for j, p in enumerate(out):
        if p.dtype != first.dtype or p.device != first.device:
            raise RaggedPartsError(
                f"{op}: part {j} is {p.dtype} on {p.device} but part 0 is "
                f"{first.dtype} on {first.device}; all parts must share dtype and device"
            )
    return list(out)


def check_src(src: int, world_size: int) -> int:
    """A broadcast root that names a rank of the group."""
    if not 0 <= src < world_size:
        raise RaggedPartsError(f"broadcast src {src} is not a rank of a group of {world_size}")
    return src


def check_same_shape(shapes: list[tuple[int, ...]], op: str) -> None:
    """Every rank passed the same shape; otherwise RaggedPartsError naming the first difference."""
    for r, s in enumerate(shapes):
        if s != shapes[0]:
            raise RaggedPartsError(
                f"{op}: rank {r} passed shape {s} but rank 0 passed {shapes[0]}; "
                f"the op needs equal shapes on every rank"
            )


def check_gather_shapes(shapes: list[tuple[int, ...]], dim: int, op: str) -> None:
    """all_gather parts agree on every dimension except `dim`."""
    first = shapes[0]
    for r, s in enumerate(shapes):
        if len(s) != len(first) or any(
            a != b for i, (a, b) in enumerate(zip(s, first)) if i != dim
        ):
            raise RaggedPartsError(
                f"{op}: rank {r} passed shape {s} and rank 0 passed {first}; parts may differ "
                f"only along dim {dim}"
            )


class CommTimeoutError(CommError, TimeoutError):
    """A rank did not reach the collective within the per-op timeout."""
