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
