"""The mixture-of-experts block of one TP rank: `ParallelMoE`, the reference `models.moe.MoE`
holding this rank's share of the experts, whose partials meet in one all-reduce.

With the router's weights p_e(x) (replicated: every rank routes the full, replicated x alike) and
expert e = down_e(silu(gate_e x) * up_e x):

  placement "tp" (rows): gate_e and up_e split along their output rows, down_e along its input
      columns, the same span `[a_r, b_r)` for every expert (`TPPlan.expert_rows`):

          y = sum_e p_e down_e[:, a:b] (silu(gate_e[a:b] x) * up_e[a:b] x)   summed over r

      since SwiGLU is elementwise over the rows, each rank's rows are exactly the monolith's.
  placement "experts": rank r holds experts `[f_r, l_r)` whole (`TPPlan.experts`):

          y = sum_{e chosen, f_r <= e < l_r} p_e expert_e(x)                  summed over r

  A shared expert (always active, sigmoid-gated) is row-split like a dense MLP in both; its gate
  scalar is computed from the replicated x on every rank and scales the rank's partial.

  gpt-oss's expert biases: gate/up biases go with their rows (whole experts: with the expert); the
  down bias b_e enters as p_e b_e once per chosen expert, so only one rank adds it: the expert's
  holder, or under "tp" the first rank holding rows (`holds_down_bias`). Its clamped activation is
  elementwise over the rows, like SwiGLU.

Either way `partial` is this rank's sum and `comm.all_reduce_sum` adds the ranks' partials: one
all-reduce per MoE block, as for a dense MLP. Float32 summation order differs from one device (per
expert rows, then ranks) and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tandem.comm.base import Communicator
from tandem.models.moe import MoE
from tandem.models.quant.linear import QuantExpertLinear
from tandem.moe_config import MoESpec
from tandem.parallel.plan import TPPlan
from tandem.parallel.tensor import ColumnParallelLinear, RowParallelLinear, _placeholder


class PartialLinear(RowParallelLinear):
    """`X_r A_r^T`, a row-parallel layer's partial without its all-reduce: the enclosing block
    (the shared expert's down projection inside `ParallelMoE`) sums every partial at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)


class ParallelMoE(MoE):
    """This rank's `MoE` (module docstring): `forward(x)` = all-reduce of `partial(x)`."""

    def __init__(
        self, hidden: int, spec: MoESpec, comm: Communicator, experts, rows, shared, down_bias
    ):
        first, count = experts.start, experts.size
        super().__init__(hidden, spec, (first, count), rows.size, shared, down_bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)  # (..., D): this rank's experts / rows
        return y if self.comm.world_size == 1 else self.comm.all_reduce_sum(y)


def holds_down_bias(plan: TPPlan, rank: int) -> bool:
    """Whether `rank` adds its experts' down biases (module docstring)."""
    if plan.moe == "experts":
        return True
    first = next(r for r, s in enumerate(plan.expert_rows) if s.size)
    return rank == first


def parallel_moe(
    hidden: int,
    spec: MoESpec,
    plan: TPPlan,
    comm: Communicator,
    prefix: str,
    qtypes: Mapping[str, int],
) -> ParallelMoE:
    """Rank `comm.rank`'s sparse block on the meta device; `prefix` is the layer's
    `model.layers.<i>.`, `qtypes` the GGUF types of quantized tensors (those projections are
    built over blocks, filled by `shard_load`)."""
    r = comm.rank
    experts, rows = plan.experts[r], plan.expert_rows[r]
    shared = plan.shared_rows[r].size if spec.shared_intermediate_size else None
    moe = ParallelMoE(hidden, spec, comm, experts, rows, shared, holds_down_bias(plan, r))
    ex = moe.experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        qtype = qtypes.get(f"{prefix}mlp.experts.{name}.weight")
        if qtype is None:
            continue
        proj = getattr(ex, name)
        out, cols = proj.out_features, proj.in_features
        blocks = _placeholder(qtype, experts.size * out, cols).view(experts.size, out, -1)
        q = QuantExpertLinear(qtype, experts.size, cols, out, blocks, proj.bias)
        setattr(ex, name, q)
    if shared is not None:
        moe.shared_expert = _shared_expert(hidden, shared, comm, prefix, qtypes)
    return moe


def _shared_expert(hidden, width, comm, prefix, qtypes) -> nn.Module:
    from tandem.models.layers import MLP

    mlp = MLP(hidden, width, False)
    q = f"{prefix}mlp.shared_expert."
    mlp.gate_proj = ColumnParallelLinear(hidden, width, False, qtype=qtypes.get(q + "gate_proj.weight"), device="meta")  # fmt: skip
    mlp.up_proj = ColumnParallelLinear(hidden, width, False, qtype=qtypes.get(q + "up_proj.weight"), device="meta")  # fmt: skip
    mlp.down_proj = PartialLinear(width, hidden, False, comm, qtype=qtypes.get(q + "down_proj.weight"), device="meta")  # fmt: skip
    return mlp
