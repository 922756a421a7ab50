"""The attention of a rank that holds no heads (`TPPlan.attn_ranks` < world size).

The layer's attention output is `sum_r o_proj_r(attn_r(x))` over the A attention ranks (the
row-parallel all-reduce of `RowParallelLinear`). A rank outside them holds no q/k/v/o weights and
no KV cache; it still meets that all-reduce, adding zeros (x + 0 = x exactly), so the group's sum
is the A-rank attention's and every rank's collectives stay in step.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.comm.base import Communicator


class AbsentAttention(nn.Module):
    """x (B, T, D) -> the group's attention output (B, T, D), contributing nothing of its own."""

    n_heads = 0
    n_kv_heads = 0  # `KVCache.for_model` sizes this layer's cache to zero

    def __init__(self, comm: Communicator, layer_idx: int, head_dim: int) -> None:
        super().__init__()
        self.comm = comm
        self.layer_idx = layer_idx
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return self.comm.all_reduce_sum(x.new_zeros(x.shape))
