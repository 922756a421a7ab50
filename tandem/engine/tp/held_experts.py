"""What each rank's loaded shard really holds of a mixture of experts, gathered on every rank once
the shards are loaded: the cluster view's witness that the placement the plan states is the one
the ranks loaded (`cluster_info.RankFacts.experts["loaded"]`).

Per rank, from the `Experts` modules of its model (one per group of experts of a sparse layer,
`parallel.moe`; every sparse layer holds the same groups): each group's `first`, `count` (its
experts `[first, first + count)`) and `width` (rows of each it holds), `layers` (sparse layers
held) and `bytes` (every expert tensor's bytes as loaded: float weights at the compute dtype,
quantized blocks as stored, biases included). The gathered row is fixed-size: `layers`, `bytes`,
the number of groups G, then (first, count, width) for at most `world_size` groups (a rank holds
at most N: `parallel.expert_split`), zero-padded. A dense model's rank sends layers 0. The gather
is an all-gather, so it also stands as the "every shard loaded" barrier.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.comm.base import Communicator
from tandem.models.moe import Experts


def held(model: nn.Module, max_groups: int) -> list[int]:
    """This rank's row (module docstring), `3 + 3 max_groups` long."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    row = [0] * (3 + 3 * max_groups)
    if not experts:
        return row
    groups = sorted({(m.first, m.count, m.width) for m in experts})
    tensors = [t for m in experts for t in (*m.parameters(), *m.buffers())]
    unique = {id(t): t for t in tensors}.values()
    nbytes = sum(t.numel() * t.element_size() for t in unique if t.device.type != "meta")
    layers = len(experts) // len(groups)
    row[:3] = [layers, nbytes, len(groups)]
    for i, g in enumerate(groups[:max_groups]):
        row[3 + 3 * i : 6 + 3 * i] = g
    return row


def gather_held(comm: Communicator, model: nn.Module) -> list[dict[str, Any] | None]:
    """Every rank's `held` row as a dict (None for a dense model's), on every rank."""
    n = comm.world_size
    mine = torch.tensor([held(model, n)], dtype=torch.int64)
    rows = comm.all_gather(mine, 0).tolist()
    out: list[dict[str, Any] | None] = []
    for layers, nbytes, count, *groups in rows:
        out.append(None if layers == 0 else {
            "groups": [[f, f + c, w] for f, c, w in zip(*[iter(groups[: 3 * count])] * 3)],
            "sparse_layers": layers, "bytes": nbytes,
        })  # fmt: skip
    return out
