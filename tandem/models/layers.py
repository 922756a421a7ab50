"""The small building blocks of a decoder layer: RMSNorm and the SwiGLU MLP (Llama), Gemma's
RMSNorm and GELU-tanh gated MLP, and `make_norm`, the norm a config asks for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps). The fused `F.rms_norm` kernel accumulates in float32 and
    rounds once; in float32 it equals HF's op-by-op form bit for bit."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Tensor parallelism splits gate/up by columns and
    down by rows, so the product needs no communication until down's all-reduce."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GemmaRMSNorm(nn.Module):
    """y = (offset + w) * x / sqrt(mean(x^2) + eps), computed in float32 and rounded once to x's
    dtype (HF's Gemma3RMSNorm: `(x * w).to(dtype)`, where Llama rounds x first). An HF checkpoint
    stores w (offset 1); llama.cpp's converter stores 1 + w (offset 0)."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).type_as(x)


class GeluTanhMLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gelu_tanh(z) = z/2 (1 + tanh(sqrt(2/pi) (z +
    0.044715 z^3))) (HF's `gelu_pytorch_tanh`). Split for tensor parallelism as SwiGLU is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def make_norm(config, dim: int) -> nn.Module:
    """The RMSNorm `config` asks for over `dim` features: Gemma's where `norm_weight_offset` is
    set, else Llama's."""
    if config.norm_weight_offset is not None:
        return GemmaRMSNorm(dim, config.rms_norm_eps, config.norm_weight_offset)
    return RMSNorm(dim, config.rms_norm_eps)
