"""Grouped-query self-attention with RoPE, optional per-head q/k RMSNorm (Qwen3) and qkv bias (Qwen2).

The head counts are this module's own attributes `n_heads` and `n_kv_heads`: one device holds them
all; a tensor-parallel transform replaces the projections with column/row-parallel ones and sets the
local counts, and nothing here changes. Query head h reads key/value head h // (n_heads/n_kv_heads).

`tandem.kernels.linear.prepare_linear_kernels` may fuse q/k/v into one `qkv_proj` whose weight is
[W_q; W_k; W_v] (rows stacked, biases likewise): one GEMV instead of three; its output splits back
into q, k, v along the last dimension (`FUSED`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.kernels import native
from tandem.models.context import ForwardContext
from tandem.models.layers import RMSNorm
from tandem.models.rope import apply_rope


class Attention(nn.Module):
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # fused name -> parts, in row order

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
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Module | None = None  # set by prepare_linear_kernels

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x (B, T, D) or flattened (B*T, D) -> the same shape."""
        B, T = ctx.positions.shape
        hd, H, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split((H * hd, Hkv * hd, Hkv * hd), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if native.handles(q) and ctx.cos.dtype == q.dtype:
            # one call per tensor, in place on the projection's output: q/k norm, then RoPE
            for t, n, norm in ((q, H, self.q_norm), (k, Hkv, self.k_norm)):
                w, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
                native.norm_rope_(t.view(-1, n * hd), n, w, eps, ctx.cos, ctx.sin)  # a view
            q, k, v = q.view(B, T, H, hd), k.view(B, T, Hkv, hd), v.view(B, T, Hkv, hd)
        else:
            q = q.view(B, T, H, hd)
            k = k.view(B, T, Hkv, hd)
            v = v.view(B, T, Hkv, hd)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rope(q, ctx.cos, ctx.sin)
            k = apply_rope(k, ctx.cos, ctx.sin)

        if ctx.cache is not None:
            keys, values = ctx.cache.update(self.layer_idx, k, v, ctx)  # (B, Hkv, S, hd)
        else:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, hd)
        n_rep = H // Hkv
        if T == 1 and not ctx.is_causal:
            # decode: fold the n_rep query heads sharing a kv head into the query axis, so the
            # kernel reads each cached key once and no repeated copy of the cache is made
            qg = q.view(B, Hkv, n_rep, hd)  # (B, Hkv, n_rep, hd)
            if ctx.attn_mask is None and native.handles(qg) and keys.stride(-1) == 1:
                out = native.decode_attention(qg, keys, values)  # every cached key visible
            else:
                out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=ctx.attn_mask)
        else:
            if n_rep > 1:
                keys = keys.repeat_interleave(n_rep, dim=1)  # (B, H, S, hd)
                values = values.repeat_interleave(n_rep, dim=1)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=ctx.attn_mask, is_causal=ctx.is_causal
            )  # (B, H, T, hd)
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(*x.shape[:-1], H * hd))
