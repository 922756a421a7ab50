"""World size 1: every collective is the identity (after the same validation every backend runs,
so a single-device run fails on exactly the inputs a cluster would refuse)."""

from __future__ import annotations

import torch

from tandem.comm import base


class SoloCommunicator:
    """The communicator of a one-rank group: rank 0, world size 1, no wire."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return base.check_tensor(t, "all_reduce_sum", reduce=True)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_dim(base.check_tensor(t, "all_gather", reduce=False), dim, "all_gather")
        return t

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "reduce_scatter", reduce=True)
        base.check_dim(t, dim, "reduce_scatter")
        return t

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return base.check_parts(parts, 1, "all_to_all")

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        base.check_src(src, 1)
        return base.check_tensor(t, "broadcast", reduce=False)

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
