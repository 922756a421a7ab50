"""Gemma 3's decoder blocks, as their differences from the Llama ones (the config switches are
stated in `models.families.gemma3`):

    GemmaAttention          Attention with Gemma's (offset + w) q/k norms, logits scaled by
                            query_pre_attn_scalar^-1/2, and the rope table of its layer kind (a
                            windowed layer's own base, `ForwardContext.rotary`)
    SandwichDecoderLayer    four norms: h' = h + post_attn(attn(input(h)));
                            out = h' + post_ffn(mlp(pre_ffn(h')))

Tensor parallelism needs nothing new: the norms act on whole rows (replicated), q/k norms per
head (replicated), and the attention and MLP projections are split as Llama's; the post norms
apply after the row-parallel all-reduce, to the full sum. The fast modules (`kernels.modules`)
replace the Llama classes by exact type, so these keep the reference math, their linear layers
still on the native kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.models.attention import Attention
from tandem.models.context import ForwardContext
from tandem.models.layers import MLP, GeluTanhMLP, make_norm
from tandem.models.moe import MoE


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if self.sinks is not None:
            raise ValueError("Gemma attention has no sinks")
        self.scale = config.attention_scale
        self.rope_local = config.rope_local(layer_idx)
        if config.qk_norm:
            self.q_norm = make_norm(config, self.head_dim)
            self.k_norm = make_norm(config, self.head_dim)

    def rotary(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The local layers' table on a local layer, the global one elsewhere."""
        return ctx.rotary(self.rope_local)


class SandwichDecoderLayer(nn.Module):
    """A decoder layer with a norm before and after each block (module docstring)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        D = config.hidden_size
        self.self_attn = GemmaAttention(config, layer_idx)
        if config.is_sparse(layer_idx):
            self.mlp: nn.Module = MoE(D, config.moe)
        elif config.mlp_activation == "gelu_tanh":
            self.mlp = GeluTanhMLP(D, config.intermediate_size, config.mlp_bias)
        else:
            self.mlp = MLP(D, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = make_norm(config, D)
        self.post_attention_layernorm = make_norm(config, D)
        self.pre_feedforward_layernorm = make_norm(config, D)
        self.post_feedforward_layernorm = make_norm(config, D)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), ctx))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
