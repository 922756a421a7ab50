"""The Qwen3.5 / Qwen3.6 hybrid's decoder blocks, as their differences from the Llama ones (the
config switches are stated in `models.families.qwen3_5`):

    HybridDecoderLayer   pre-norm, h' = h + mixer(input(h)); out = h' + ffn(post_attention(h')),
                         the mixer a `GatedDeltaNet` (`linear_attn`) on the config's linear
                         layers and `GatedAttention` (`self_attn`) on the others; the FFN the
                         gated MLP, or the MoE block with its sigmoid-gated shared expert
    GatedAttention       q_proj yields, per head, hd query rows then hd gate rows;
                         out = o_proj(attn(q, k, v) * sigmoid(gate)); q/k RMSNorm per head;
                         partial rotary (`rotary_dim` of each head)
    norms                (1 + w) RMSNorm in float32, rounded once (`norm_weight_offset` 1.0),
                         except the DeltaNet's own gated norm (plain w)

The fast modules (`kernels.modules`) replace the Llama classes by exact type, so these keep the
reference math, their linear layers still on the native kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.models.attention import Attention
from tandem.models.context import ForwardContext
from tandem.models.deltanet import GatedDeltaNet
from tandem.models.layers import MLP, make_norm
from tandem.models.moe import MoE


class GatedAttention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        hd = self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.n_heads * hd, bias=config.qkv_bias)
        if config.qk_norm:
            self.q_norm = make_norm(config, hd)
            self.k_norm = make_norm(config, hd)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x (B, T, D) or flattened (B*T, D) -> the same shape."""
        hd, H = self.head_dim, self.n_heads
        lead = x.shape[:-1]
        qg = self.q_proj(x).view(*lead, H, 2 * hd)  # per head: hd query rows, then hd gate rows
        q = qg[..., :hd].reshape(*lead, H * hd)
        gate = qg[..., hd:].reshape(*lead, H * hd)
        q, k, v = self.position(q, self.k_proj(x), self.v_proj(x), ctx)
        if ctx.cache is not None:
            keys, values = ctx.cache.update(self.layer_idx, k, v, ctx.writes)  # (B, Hkv, S, hd)
        else:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, hd)
        out = self.attend(q, keys, values, ctx).reshape(*lead, H * hd)
        return self.o_proj(out * torch.sigmoid(gate))


class HybridDecoderLayer(nn.Module):
    """A decoder layer of the hybrid (module docstring)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        D = config.hidden_size
        self.linear = config.is_linear(layer_idx)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        if config.is_sparse(layer_idx):
            self.mlp: nn.Module = MoE(D, config.moe)
        else:
            self.mlp = MLP(D, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = make_norm(config, D)
        self.post_attention_layernorm = make_norm(config, D)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.linear else self.self_attn

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.mixer(self.input_layernorm(h), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))
