"""The mixture-of-experts block of one TP rank: `ParallelMoE`, the reference `models.moe.MoE`
holding this rank's share of the experts, whose partials meet in one all-reduce.

With the router's weights p_e(x) (replicated: every rank routes the full, replicated x alike) and
expert e = down_e(silu(gate_e x) * up_e x), rank r holds groups g of experts `[f_g, l_g)` with
rows `[a_g, b_g)` of each (`TPPlan.expert_groups`):

  placement "tp" (rows): gate_e and up_e split along their output rows, down_e along its input
      columns; every expert's rows tile `[0, w)` over the ranks, cut alike within a group
      (`parallel.expert_split`: where the width's blocks do not divide evenly, consecutive
      experts are cut differently so each rank's total follows its weight):

          partial_r = sum_g sum_{e chosen, f_g <= e < l_g} p_e down_e[:, a_g:b_g]
                          (silu(gate_e[a_g:b_g] x) * up_e[a_g:b_g] x)

      since SwiGLU is elementwise over the rows, each rank's rows are exactly the monolith's, and
      y = sum_r partial_r.
  placement "experts": rank r holds experts `[f_r, l_r)` whole (one group, rows `[0, w)`):

          partial_r = sum_{e chosen, f_r <= e < l_r} p_e expert_e(x)

  A shared expert (always active, sigmoid-gated) is row-split like a dense MLP in both; its gate
  scalar is computed from the replicated x on every rank and scales the rank's partial.

  gpt-oss's expert biases: gate/up biases go with their rows; the down bias b_e enters as p_e b_e
  once per chosen expert, so only one rank adds it: the one holding the expert's first rows
  (a_g = 0: the whole expert's holder under "experts"; `holds_down_bias`). Its clamped activation
  is elementwise over the rows, like SwiGLU.

Each group is one reference `Experts` module (uniform width: one stacked (n_g, rows, ...) tensor
per projection, one native call under the kernels): the first is `mlp.experts`, the others
`mlp.expert_groups.<g>` (`shard_load.source_name` maps them back to the file's `mlp.experts.*`).
`partial` is this rank's sum and `comm.all_reduce_sum` adds the ranks' partials: one all-reduce
per MoE block, as for a dense MLP. Float32 summation order differs from one device (per group of
rows, then ranks) and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from tandem.comm.base import Communicator
from tandem.models.moe import Experts, MoE
from tandem.models.quant.linear import QuantExpertLinear
from tandem.moe_config import MoESpec
from tandem.parallel.expert_split import ExpertGroup
from tandem.parallel.plan import TPPlan
from tandem.parallel.tensor import ColumnParallelLinear, RowParallelLinear, _placeholder

_GROUP = re.compile(r"(.*\.mlp\.)expert_groups\.(\d+)\.(.*)")


class PartialLinear(RowParallelLinear):
    """`X_r A_r^T`, a row-parallel layer's partial without its all-reduce: the enclosing block
    (the shared expert's down projection inside `ParallelMoE`) sums every partial at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)


class ParallelMoE(MoE):
    """This rank's `MoE` (module docstring): `forward(x)` = all-reduce of `partial(x)`; its
    first group of experts is `experts`, any others `expert_groups`."""

    def __init__(
        self,
        hidden: int,
        spec: MoESpec,
        comm: Communicator,
        groups: tuple[ExpertGroup, ...],
        shared: int | None,
    ):
        g0 = groups[0]
        span = (g0.experts.start, g0.experts.size)
        super().__init__(hidden, spec, span, g0.rows.size, shared, holds_down_bias(g0))
        self.comm = comm
        self.expert_groups = nn.ModuleDict({
            str(i): Experts(g.experts.size, hidden, g.rows.size, g.experts.start, spec, holds_down_bias(g))
            for i, g in enumerate(groups[1:], 1)
        })  # fmt: skip

    def expert_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, weights, ids)  # (N, D)
        for group in self.expert_groups.values():
            y = y + group(x, weights, ids)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)  # (..., D): this rank's experts / rows
        return y if self.comm.world_size == 1 else self.comm.all_reduce_sum(y)


def holds_down_bias(group: ExpertGroup) -> bool:
    """Whether the rank holding `group` adds its experts' down biases: it holds their first rows
    (module docstring)."""
    return group.rows.start == 0


def expert_group_of(param_name: str) -> tuple[str, int]:
    """(the checkpoint name, the group index) of a `ParallelMoE` parameter: `mlp.expert_groups.<g>.`
    names group g's share of `mlp.experts.`; anything else is itself, group 0."""
    m = _GROUP.fullmatch(param_name)
    if m is None:
        return param_name, 0
    return f"{m.group(1)}experts.{m.group(3)}", int(m.group(2))


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
    shared = plan.shared_rows[r].size if spec.shared_intermediate_size else None
    moe = ParallelMoE(hidden, spec, comm, plan.expert_groups[r], shared)
    for ex in (moe.experts, *moe.expert_groups.values()):
        _over_blocks(ex, prefix, qtypes)
    if shared is not None:
        moe.shared_expert = _shared_expert(hidden, shared, comm, prefix, qtypes)
    return moe


def _over_blocks(ex: Experts, prefix: str, qtypes: Mapping[str, int]) -> None:
    """Each projection of one group whose file tensor is quantized, as meta blocks."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        qtype = qtypes.get(f"{prefix}mlp.experts.{name}.weight")
        if qtype is None:
            continue
        proj = getattr(ex, name)
        out, cols = proj.out_features, proj.in_features
        blocks = _placeholder(qtype, ex.count * out, cols).view(ex.count, out, -1)
        setattr(ex, name, QuantExpertLinear(qtype, ex.count, cols, out, blocks, proj.bias))


def _shared_expert(hidden, width, comm, prefix, qtypes) -> nn.Module:
    from tandem.models.layers import MLP

    mlp = MLP(hidden, width, False)
    q = f"{prefix}mlp.shared_expert."
    mlp.gate_proj = ColumnParallelLinear(hidden, width, False, qtype=qtypes.get(q + "gate_proj.weight"), device="meta")  # fmt: skip
    mlp.up_proj = ColumnParallelLinear(hidden, width, False, qtype=qtypes.get(q + "up_proj.weight"), device="meta")  # fmt: skip
    mlp.down_proj = PartialLinear(width, hidden, False, comm, qtype=qtypes.get(q + "down_proj.weight"), device="meta")  # fmt: skip
    return mlp
