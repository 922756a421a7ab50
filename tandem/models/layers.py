"""The small building blocks of a Llama-family decoder layer: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import native


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps). The fused `F.rms_norm` kernel accumulates in float32 and
    rounds once; in float32 it equals HF's op-by-op form bit for bit. On a CPU with tandem's native
    kernels (`native.rmsnorm`) the same form is one call instead of ~10 dispatches: equal to
    F.rms_norm bit for bit in bf16 / f16, within float32 rounding (sum order) in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and native.handles(x):
            return native.rmsnorm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Tensor parallelism splits gate/up by columns and
    down by rows, so the product needs no communication until down's all-reduce.

    `prepare_linear_kernels` may fuse gate and up into one `gate_up_proj` with weight
    [W_gate; W_up]: one GEMV, its output (..., 2 * intermediate) halved back into gate and up."""

    FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}  # fused name -> parts, in row order

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # set by prepare_linear_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)  # (..., 2I)
            if native.handles(gate_up):
                return self.down_proj(native.silu_mul(gate_up))  # (..., 2I) -> (..., I)
            gate, up = gate_up.chunk(2, -1)  # (..., 2I) -> 2 x (..., I)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
