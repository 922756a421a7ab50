"""`FastAttention`: the reference `Attention` with fused q/k/v, q/k norm + RoPE in place and a
step's attention in one native call (`modules` module docstring). Below both `modules`, which
swaps it in, and `decode_model`, which runs a model of them in one call.
"""

from __future__ import annotations

import torch

from tandem.kernels import linear, native
from tandem.models.attention import Attention
from tandem.models.context import ForwardContext


class FastAttention(Attention):
    """`qkv_proj`, when prepare_linear_kernels fused q/k/v, has weight [W_q; W_k; W_v] (rows
    stacked, biases likewise): one GEMV instead of three, split back along the last dimension."""

    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # fused name -> parts, in row order

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return super().project(x)
        hd = self.head_dim
        return self.qkv_proj(x).split(
            (self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd), -1
        )

    def position(self, q, k, v, ctx: ForwardContext):
        # partial rotary (a table narrower than the head: Phi-4-mini) keeps the reference's RoPE
        if not (
            native.handles(q) and ctx.cos.dtype == q.dtype and ctx.cos.shape[-1] == self.head_dim
        ):
            return super().position(q, k, v, ctx)
        B, T = ctx.positions.shape
        hd, H, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        # one call per tensor, in place on the projection's output: q/k norm, then RoPE
        for t, n, norm in ((q, H, self.q_norm), (k, Hkv, self.k_norm)):
            w, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
            native.norm_rope_(t.view(-1, n * hd), n, w, eps, ctx.cos, ctx.sin)  # a view
        return q.view(B, T, H, hd), k.view(B, T, Hkv, hd), v.view(B, T, Hkv, hd)

    def attend(self, q, keys, values, ctx: ForwardContext) -> torch.Tensor:
        """Every step with a cache on the native call (`native.step_attention`): prefill chunks
        at any start, decode rows of any lengths, the layer's window and sinks, one query row at
        a time over exactly its visible keys, so a row's output does not depend on the step's
        other rows (the reference's masked SDPA sums a row differently by the step's shape).
        Its price is a long prefill: a loop per query row against SDPA's tiled kernel, measured
        here (Sapphire Rapids, 2 threads, 16 q / 8 kv heads of 128, one causal prompt) 1.5-4x
        SDPA's time in float32 and 4-10x in bfloat16 at 128-1024 tokens. With
        `linear.LIBRARY_PREFILL` a step of more than one token per row takes SDPA instead (not
        batch-invariant)."""
        if (
            not (linear.LIBRARY_PREFILL and q.shape[1] > 1)
            and ctx.cache is not None
            and len(ctx.start_pos) == q.shape[0]
            and native.handles(q)
            and q.dtype == keys.dtype == values.dtype
            and keys.stride(-1) == 1
            and values.stride(-1) == 1
            and self.head_dim <= native.MAX_HEAD_DIM
        ):
            if q.stride(-1) != 1 or q.stride(-2) != self.head_dim:
                q = q.contiguous()
            sinks = None if self.sinks is None else self.sinks.to(q.dtype)
            return native.step_attention(
                q, keys, values, ctx.start_pos, ctx.lengths, self.window, sinks
            )  # (B, T, H, hd)
        return super().attend(q, keys, values, ctx)
