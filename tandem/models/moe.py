"""The mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral, gpt-oss) in plain PyTorch.

For a token x (D), the router (`gate`, a linear map to E logits, biased in gpt-oss) picks the
experts, by one of two rules (`MoESpec.router`):

    softmax_topk:  p = softmax(gate(x)) over all E, in float32;  (w, ids) = topk(p, k);
                   w /= sum(w) only with `norm_topk_prob`
    topk_softmax:  (l, ids) = topk(gate(x), k);  w = softmax(l)          (gpt-oss)

    y = sum_j w_j * down_{ids_j}(act(gate_{ids_j} x, up_{ids_j} x))   (+ the shared expert)

`act` is SwiGLU, or gpt-oss's clamped form (`moe_config`); gpt-oss's experts add a bias after each
projection. Each projection's experts are one `ExpertLinear`, weight (E, out, in) stacked by
expert (bias (E, out)), under the names `mlp.experts.{gate,up,down}_proj.{weight,bias}` (the
loaders stack a checkpoint's per-expert or fused tensors, or a GGUF file's `ffn_*_exps`, into them).

A block may hold only some of the experts and a slice of each (`held`, the experts' widths): that
is how the parallel transforms cut it (`tandem.parallel.moe`). `partial(x)` is then this block's
share of y, the sum over the held experts of the held rows; the shards' partials add up to y. A
down-projection bias belongs to one shard only (`down_bias`): it is added once per chosen expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers import MLP
from tandem.moe_config import MoESpec


class ExpertLinear(nn.Module):
    """E linear maps stacked by expert: `weight` (E, out, in) and `bias` (E, out) when `bias`;
    expert e computes `x W_e^T + b_e`."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n_experts, out_features)) if bias else None

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x (N, in) through the held expert at index `e` (0-based in this module) -> (N, out)."""
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's activation (`moe_config`): (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    g = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


class Experts(nn.Module):
    """The experts `[first, first + count)` of a sparse layer (all of them on one device), each a
    gated MLP of `width` rows (all of them on one device) with the spec's activation and biases;
    the down bias only where `down_bias` (module docstring)."""

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        width: int,
        first: int = 0,
        spec: MoESpec | None = None,
        down_bias: bool = True,
    ) -> None:
        super().__init__()
        self.first, self.count, self.width = first, n_experts, width
        bias = spec is not None and spec.expert_bias
        self.activation = "swiglu" if spec is None else spec.activation
        self.alpha, self.limit = (
            (1.702, 7.0) if spec is None else (spec.swiglu_alpha, spec.swiglu_limit)
        )
        self.gate_proj = ExpertLinear(n_experts, hidden, width, bias)
        self.up_proj = ExpertLinear(n_experts, hidden, width, bias)
        self.down_proj = ExpertLinear(n_experts, width, hidden, bias and down_bias)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu_clamped":
            return clamped_swiglu(gate, up, self.alpha, self.limit)
        return F.silu(gate) * up

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x (N, D) through held expert `e` (local index) -> (N, D)."""
        return self.down_proj(self.act(self.gate_proj(x, e), self.up_proj(x, e)), e)

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
    which rows, and the sums they make, are the parallel transform's business (as is which
    shard adds the experts' down bias, `down_bias`)."""

    def __init__(
        self,
        hidden: int,
        spec: MoESpec,
        experts: tuple[int, int] | None = None,
        width: int | None = None,
        shared_width: int | None = None,
        down_bias: bool = True,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.top_k, self.norm_topk_prob = spec.top_k, spec.norm_topk_prob
        self.gate = nn.Linear(hidden, spec.num_experts, bias=spec.router_bias)
        first, count = experts or (0, spec.num_experts)
        width = width or spec.intermediate_size
        self.experts = Experts(count, hidden, width, first, spec, down_bias)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = MLP(hidden, shared_width or spec.shared_intermediate_size, False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> (weights (N, k) in x's dtype, expert ids (N, k) int64)."""
        logits = self.gate(x)  # (N, E)
        if self.spec.router == "topk_softmax":
            top, ids = torch.topk(logits, self.top_k, dim=-1)  # (N, k)
            return F.softmax(top, dim=-1), ids
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), ids

    def expert_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (N, D) routed to `ids` with `weights` (N, k) -> (N, D): the held experts' sum."""
        return self.experts(x, weights, ids)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> this block's share of y (..., D): every token routed on the full x, the
        held experts' (and shared expert's) rows applied."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        weights, ids = self.route(flat)
        y = self.expert_sum(flat, weights, ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.partial(x)
