"""What each rank's loaded shard really holds of a mixture of experts, gathered on every rank once
the shards are loaded: the cluster view's witness that the placement the plan states is the one
the ranks loaded (`cluster_info.RankFacts.experts["loaded"]`).

Per rank, from the `Experts` modules of its model (every sparse layer holds the same span):
`first` and `count` (its experts `[first, first + count)`), `width` (rows of each it holds),
`layers` (sparse layers held) and `bytes` (every expert tensor's bytes as loaded: float weights at
the compute dtype, quantized blocks as stored, biases included). A dense model's rank sends
count 0. The gather is an all-gather, so it also stands as the "every shard loaded" barrier.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.comm.base import Communicator
from tandem.models.moe import Experts

FIELDS = ("first", "count", "width", "layers", "bytes")


def held(model: nn.Module) -> list[int]:
    """This rank's row of `FIELDS` (module docstring)."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return [0, 0, 0, 0, 0]
    first = experts[0]
    tensors = [t for m in experts for t in (*m.parameters(), *m.buffers())]
    unique = {id(t): t for t in tensors}.values()
    nbytes = sum(t.numel() * t.element_size() for t in unique if t.device.type != "meta")
    return [first.first, first.count, first.width, len(experts), nbytes]


def gather_held(comm: Communicator, model: nn.Module) -> list[dict[str, Any] | None]:
    """Every rank's `held` row as a dict (None for a dense model's), on every rank."""
    mine = torch.tensor([held(model)], dtype=torch.int64)
    rows = comm.all_gather(mine, 0).tolist()
    out: list[dict[str, Any] | None] = []
    for first, count, width, layers, nbytes in rows:
        out.append(None if layers == 0 else {
            "experts": [first, first + count], "rows": width, "sparse_layers": layers,
            "bytes": nbytes,
        })  # fmt: skip
    return out
