"""The mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral) in plain PyTorch.

For a token x (D), the router (`gate`, a linear map to E logits) picks the experts:

    p = softmax(gate(x))                     over all E experts, in float32
    (w, ids) = topk(p, k);  w /= sum(w)      the renormalisation only with `norm_topk_prob`
    y = sum_j w_j * down_{ids_j}(silu(gate_{ids_j} x) * up_{ids_j} x)   (+ the shared expert)

Each projection's experts are one `ExpertLinear`, weight (E, out, in) stacked by expert, under the
names `mlp.experts.{gate,up,down}_proj.weight` (the loaders stack a checkpoint's per-expert tensors
or a GGUF file's `ffn_*_exps` into them).

A block may hold only some of the experts and a slice of each (`held`, the experts' widths): that
is how the parallel transforms cut it (`tandem.parallel.moe`). `partial(x)` is then this block's
share of y, the sum over the held experts of the held rows; the shards' partials add up to y.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers import MLP
from tandem.moe_config import MoESpec


class ExpertLinear(nn.Module):
    """E linear maps stacked by expert: `weight` (E, out, in), expert e computes `x W_e^T`."""

    def __init__(self, n_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x (N, in) through the held expert at index `e` (0-based in this module) -> (N, out)."""
        return F.linear(x, self.weight[e])


class Experts(nn.Module):
    """The experts `[first, first + count)` of a sparse layer (all of them on one device), each a
    SwiGLU of `width` rows (all of them on one device)."""

    def __init__(self, n_experts: int, hidden: int, width: int, first: int = 0) -> None:
        super().__init__()
        self.first, self.count, self.width = first, n_experts, width
        self.gate_proj = ExpertLinear(n_experts, hidden, width)
        self.up_proj = ExpertLinear(n_experts, hidden, width)
        self.down_proj = ExpertLinear(n_experts, width, hidden)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x (N, D) through held expert `e` (local index) -> (N, D)."""
        return self.down_proj(F.silu(self.gate_proj(x, e)) * self.up_proj(x, e), e)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (N, D), the router's `weights` and global expert `ids` (N, k) -> (N, D): the sum
        over each row's chosen experts that this module holds, in ascending expert order."""
        out = torch.zeros_like(x)
        local = ids - self.first
        held = (local >= 0) & (local < self.count)
        for e in torch.unique(local[held]).tolist():
            rows, slot = torch.where(local == e)  # tokens routed to e, and where in their top-k
            y = self.expert(x[rows], e) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class MoE(nn.Module):
    """The sparse feed-forward block (module docstring); `forward` = `partial` on one device.

    By default it holds every expert whole. `experts` = (first, count) holds only those experts;
    `width` (< the spec's) only that many rows of each, `shared_width` of the shared expert:
    which rows, and the sums they make, are the parallel transform's business."""

    def __init__(
        self,
        hidden: int,
        spec: MoESpec,
        experts: tuple[int, int] | None = None,
        width: int | None = None,
        shared_width: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.top_k, self.norm_topk_prob = spec.top_k, spec.norm_topk_prob
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        first, count = experts or (0, spec.num_experts)
        self.experts = Experts(count, hidden, width or spec.intermediate_size, first)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = MLP(hidden, shared_width or spec.shared_intermediate_size, False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> (weights (N, k) in x's dtype, expert ids (N, k) int64)."""
        logits = self.gate(x)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), ids

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> this block's share of y (..., D): every token routed on the full x, the
        held experts' (and shared expert's) rows applied."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        weights, ids = self.route(flat)
        y = self.experts(flat, weights, ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.partial(x)
