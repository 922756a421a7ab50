"""Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm (Qwen3), qkv bias (Qwen2),
a sliding window on this layer (`window`, `ForwardContext.mask`) and attention sinks (gpt-oss).

With sinks, head h has a learned logit s_h that joins every softmax without a value: for a query
against keys j, p_j = exp(z_j) / (exp(s_h) + sum_i exp(z_i)), out = sum_j p_j v_j (`sink_attention`).

The head counts are this module's own attributes `n_heads` and `n_kv_heads`: one device holds them
all; a tensor-parallel transform replaces the projections with column/row-parallel ones and sets the
local counts, and nothing here changes. Query head h reads key/value head h // (n_heads/n_kv_heads).

`forward` is steps a fast path may override (`tandem.kernels.modules.FastAttention`): `project`
(x -> q, k, v), `position` (q/k norm + RoPE) and `attend` (q against the cached keys and values,
under this layer's mask; a decode step's `decode_attend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.models.context import ForwardContext
from tandem.models.layers import RMSNorm
from tandem.models.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        D = config.hidden_size
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=config.o_bias)
        self.window = config.window(layer_idx)
        self.scale: float | None = None  # q . k's factor; None: head_dim^-1/2 (SDPA's default)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if config.attn_sinks else None
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., D) -> q (..., H*hd), k and v (..., Hkv*hd)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def position(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections -> q (B, T, H, hd), k and v (B, T, Hkv, hd); q and k normed per head
        (Qwen3) and rotated."""
        B, T = ctx.positions.shape
        hd = self.head_dim
        q = q.view(B, T, self.n_heads, hd)
        k = k.view(B, T, self.n_kv_heads, hd)
        v = v.view(B, T, self.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary(ctx)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def rotary(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (cos, sin) for the step: the model's one table (a family with a table per
        layer kind overrides it)."""
        return ctx.cos, ctx.sin

    def decode_attend(
        self, qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """One new token: qg (B, Hkv, n_rep, hd) against keys/values (B, Hkv, S, hd) -> (B, Hkv,
        n_rep, hd)."""
        mask = self.mask_of(ctx)[0]
        return F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)

    def mask_of(self, ctx: ForwardContext) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) of this layer: the windowed ones where it has a window."""
        return ctx.mask(self.window is not None)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x (B, T, D) or flattened (B*T, D) -> the same shape."""
        hd, H = self.head_dim, self.n_heads
        q, k, v = self.position(*self.project(x), ctx)

        if ctx.cache is not None:
            keys, values = ctx.cache.update(self.layer_idx, k, v, ctx.writes)  # (B, Hkv, S, hd)
        else:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, hd)
        out = self.attend(q, keys, values, ctx)
        return self.o_proj(out.reshape(*x.shape[:-1], H * hd))

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """q (B, T, H, hd) against keys/values (B, Hkv, S, hd) under this layer's mask -> the
        output in (B, T, H, hd) element order (a decode step's (B, Hkv, n_rep, hd) is that)."""
        B, T = ctx.positions.shape
        hd, Hkv = self.head_dim, self.n_kv_heads
        n_rep = self.n_heads // Hkv
        mask, causal = self.mask_of(ctx)
        if self.sinks is not None:
            out = sink_attention(q.transpose(1, 2), keys, values, self.sinks, mask, causal)
            return out.transpose(1, 2)  # (B, H, T, hd) -> (B, T, H, hd)
        if T == 1 and not causal:
            # decode: fold the n_rep query heads sharing a kv head into the query axis, so the
            # kernel reads each cached key once and no repeated copy of the cache is made
            return self.decode_attend(q.view(B, Hkv, n_rep, hd), keys, values, ctx)
        if n_rep > 1:
            keys = keys.repeat_interleave(n_rep, dim=1)  # (B, H, S, hd)
            values = values.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal, scale=self.scale
        )  # (B, H, T, hd)
        return out.transpose(1, 2)


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """q (B, H, T, hd) against keys/values (B, Hkv, S, hd), each head's sink logit `sinks` (H,)
    in its softmax (module docstring) -> (B, H, T, hd). `mask` (B, 1, T, S) True = attend; `causal`
    for a plain causal step (T == S)."""
    B, H, T, hd = q.shape
    n_rep = H // keys.shape[1]
    if n_rep > 1:
        keys = keys.repeat_interleave(n_rep, dim=1)  # (B, H, S, hd)
        values = values.repeat_interleave(n_rep, dim=1)
    z = torch.matmul(q, keys.transpose(2, 3)) * hd**-0.5  # (B, H, T, S)
    if causal:
        mask = torch.ones(T, keys.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf"))
    sink = sinks.to(z.dtype).reshape(1, H, 1, 1).expand(B, H, T, 1)
    z = torch.cat([z, sink], dim=-1)  # (B, H, T, S + 1)
    z = z - z.max(dim=-1, keepdim=True).values
    p = F.softmax(z, dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(p.to(values.dtype), values)
