"""`FastGatedDeltaNet`: the reference Gated DeltaNet (`models.deltanet`) whose decode step (one token
per row, float32 on the CPU) runs the conv, the gated delta rule and the gated norm in one native
call per row (csrc/deltanet.c `tandem_deltanet_mix`, the torch-free path's own mixer), each row's
conv window and state read and written in place in its cache slot. The projections stay the
layer's own modules, so a tensor-parallel rank's shard (its q/k heads and their v heads,
`parallel.transform`) runs the same call over its heads, and out_proj's all-reduce is unchanged:

    P_b   = [in_proj_qkv(h_b) | in_proj_z(h_b) | in_proj_b(h_b) | in_proj_a(h_b)]   (B, P)
    y_b   = mix(P_b, window[slot_b], state[slot_b])                                 (B, Hv dv)
    out   = out_proj(y)                                                             (B, D)

A row at position 0 starts from zeros (its slot's window and state cleared first). A prefill (a
step of several tokens), another dtype or device keeps the reference (the chunked form). The
native sums run in another order than torch's (the conv taps, the l2 / rms sums, S^T k and S^T q):
equal within float32 rounding, not bit for bit; every row on its own (batch invariant).
"""

from __future__ import annotations

import torch

from tandem.kernels import native
from tandem.models.context import ForwardContext
from tandem.models.deltanet import GatedDeltaNet


class FastGatedDeltaNet(GatedDeltaNet):
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T = ctx.positions.shape
        if T != 1 or not self._native(x, ctx):
            return super().forward(x, ctx)
        h = x.reshape(B, x.shape[-1])  # (B, 1, D) or (B, D) -> (B, D)
        proj = torch.cat(
            [self.in_proj_qkv(h), self.in_proj_z(h), self.in_proj_b(h), self.in_proj_a(h)], -1
        )  # (B, P)
        a = (-self.A_log.exp() if self.a_log else self.A_log).contiguous()  # (Hv,), A < 0
        taps = self.conv1d.weight.reshape(self.conv_channels, self.kernel)  # (C, K), a view
        y = torch.empty(B, self.n_v_heads * self.dv)  # (B, Hv dv)
        for b, (window, state) in enumerate(self._states(ctx, B)):
            native.deltanet_mix(
                proj[b : b + 1], taps, a, self.dt_bias, self.norm.weight,
                self.norm.eps, window, state, y[b : b + 1],
                (self.n_k_heads, self.n_v_heads, self.dk, self.dv), self.v_tiled,
            )  # fmt: skip
        return self.out_proj(y).reshape(*x.shape[:-1], -1)

    def _native(self, x: torch.Tensor, ctx: ForwardContext) -> bool:
        """A decode step the native mixer takes: float32 on the CPU, every row one token, the
        float parameters float32 and the cache (when there is one) float32."""
        params = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
        cache = ctx.cache
        return (
            native.handles(x)
            and x.dtype == torch.float32
            and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
            and all(n == 1 for n in ctx.lengths)
            and (
                cache is None
                or ctx.writes is None
                or cache.conv[self.layer_idx].dtype == torch.float32
            )
        )

    def _states(self, ctx: ForwardContext, B: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's (window (C, K - 1), state (Hv, dk, dv)) to update in place: its cache
        slot's (cleared for a row from position 0), or zeros for a step without a cache."""
        C, W = self.conv_channels, self.kernel - 1
        cache = ctx.cache
        if cache is None or ctx.writes is None:
            return [
                (torch.zeros(C, W), torch.zeros(self.n_v_heads, self.dk, self.dv)) for _ in range(B)
            ]
        conv, ssm = cache.conv[self.layer_idx], cache.ssm[self.layer_idx]
        starts = ctx.start_pos or (0,) * B  # none given: every row from 0, as the reference reads
        out = []
        for slot, start in zip(ctx.writes.slots.tolist(), starts, strict=True):
            window, state = conv[slot], ssm[slot]
            if start == 0:
                window.zero_(), state.zero_()
            out.append((window, state))
        return out
