"""The fast modules: subclasses of the reference modules whose hot steps call tandem's native CPU
kernels where they apply and the reference math everywhere else. `swap_fast_modules` puts them in
place of the reference classes, in plain sight (the instance keeps its parameters and buffers; only
its class changes), as the TP transform swaps in parallel layers.

Each fast module computes what its reference computes (`tests/unit/test_native_ops.py`): the
native ops reproduce the PyTorch form's roundings (bit for bit in bf16/f16 for the norms and RoPE,
float32 rounding of the sum order in float32).

    reference       fast               what changes
    RMSNorm         FastRMSNorm        one native call instead of ~10 dispatches
    Attention       FastAttention      fused q/k/v (`FUSED`, installed by prepare_linear_kernels);
                                       q/k norm + RoPE in place, one call per tensor; a step's
                                       attention (prefill, decode, windows, sinks) in one call
    MLP             FastMLP            fused gate/up; SwiGLU in one call
    Experts         FastExperts        an MoE block's chosen experts in one call (`kernels.moe`)
    GatedDeltaNet   FastGatedDeltaNet  a decode step's conv, delta rule and gated norm in one
                                       call per row (`fast_deltanet`)
    DecoderLayer    FastDecoderLayer   one sequence, one decode token: the layer in two calls
                                       (`decode_layer`)
    Transformer     FastTransformer    one sequence, one decode token: every held layer in one
                                       call (`decode_model`)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import decode_layer, decode_model, native
from tandem.kernels.fast_attention import FastAttention
from tandem.kernels.fast_deltanet import FastGatedDeltaNet
from tandem.kernels.moe import FastExperts
from tandem.models.attention import Attention
from tandem.models.context import ForwardContext
from tandem.models.deltanet import GatedDeltaNet
from tandem.models.layers import MLP, RMSNorm
from tandem.models.llama import DecoderLayer, Transformer
from tandem.models.moe import Experts


class FastRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and native.handles(x):
            return native.rmsnorm(x, self.weight, self.eps)
        return super().forward(x)


class FastMLP(MLP):
    """`gate_up_proj`, when fused, has weight [W_gate; W_up]: one GEMV whose output (..., 2I) is
    halved back into gate and up."""

    FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}  # fused name -> parts, in row order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return super().forward(x)
        gate_up = self.gate_up_proj(x)  # (..., 2I)
        if native.handles(gate_up):
            return self.down_proj(native.silu_mul(gate_up))  # (..., 2I) -> (..., I)
        gate, up = gate_up.chunk(2, -1)  # (..., 2I) -> 2 x (..., I)
        return self.down_proj(F.silu(gate) * up)


class FastDecoderLayer(DecoderLayer):
    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # a TP rank without attention heads (`parallel.absent`) keeps the per-module path
        if isinstance(self.self_attn, FastAttention) and decode_layer.eligible(self, h, ctx):
            return decode_layer.run(self, h, ctx)  # one decode token: two native calls
        return super().forward(h, ctx)


class FastTransformer(Transformer):
    """`dtype` and `device` read a parameter found once (the reference walks the module tree for
    it, ~6 times a step: ~0.1 ms of a few-ms token on a small model); a parameter keeps its
    identity through `.to()`, so they follow a later conversion."""

    @property
    def dtype(self) -> torch.dtype:
        return self._first_parameter().dtype

    @property
    def device(self) -> torch.device:
        return self._first_parameter().device

    def _first_parameter(self) -> torch.Tensor:
        p = self.__dict__.get("_first_param")
        if p is None:
            p = self.__dict__["_first_param"] = next(self.parameters())
        return p

    def forward_layers(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if h.dim() == 3 and h.shape[0] * h.shape[1] == 1:  # (1, 1, D): one decode token
            layers = list(self.model.layers.values())
            out = decode_model.run(self, layers, h.reshape(1, h.shape[-1]), ctx)  # (1, D)
            if out is not None:
                return out.view(h.shape)
        return super().forward_layers(h, ctx)


FAST: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: FastRMSNorm,
    Attention: FastAttention,
    MLP: FastMLP,
    Experts: FastExperts,
    GatedDeltaNet: FastGatedDeltaNet,
    DecoderLayer: FastDecoderLayer,
    Transformer: FastTransformer,
}


def swap_fast_modules(model: nn.Module) -> int:
    """Gives every reference module of `model` its fast class, in place; returns how many changed.
    A fused module starts with its fused projection unset (None): prepare_linear_kernels fills it.
    Calling it again is a no-op."""
    n = 0
    for m in model.modules():
        fast = FAST.get(type(m))
        if fast is None:
            continue
        m.__class__ = fast
        for fused in getattr(fast, "FUSED", {}):
            setattr(m, fused, None)
        n += 1
    return n
