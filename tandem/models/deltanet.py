"""The Gated DeltaNet token mixer of Qwen3.5 / Qwen3.6 (HF `Qwen3_5GatedDeltaNet`) in plain PyTorch.

For x (B, T, D), with Hk q/k heads of dk, Hv v heads of dv (`DeltaNetSpec`), window K:

    qkv = conv_silu(in_proj_qkv(x))      causal depthwise conv over the 2 Hk dk + Hv dv channels
                                         (each channel its own K taps, over this and the K - 1
                                         earlier inputs), then SiLU; split into q, k, v by heads
    q, k = l2norm(q), l2norm(k)          per head; q also times dk^-1/2; each q/k head serves
                                         Hv / Hk consecutive v heads
    beta = sigmoid(in_proj_b(x))         (Hv,) per token
    g    = -exp(A_log) softplus(in_proj_a(x) + dt_bias)    (Hv,) per token, float32 (a GGUF
                                         stores A = -exp(A_log) itself: `DeltaNetSpec.a_log`)
    o    = delta_rule(q, k, v, g, beta)  `models.delta_rule`: chunked for a step of several
                                         tokens, recurrent for one
    y    = out_proj(rmsnorm_w(o) * silu(in_proj_z(x)))     per v head (`GatedRMSNorm`)

A sequence's state between steps is its last K - 1 conv inputs (C, K - 1) and a (dk, dv) matrix
per v head (float32), held in its cache slot (`KVCache.conv` / `KVCache.ssm`); a row starting at
position 0 starts from zeros. A step's padded tokens (past a row's length) get g = 0, beta = 0 and
are left out of the conv window, so the state kept is the one after the row's last real token.

The head counts are this module's own attributes (`n_k_heads`, `n_v_heads`): a tensor-parallel
transform gives a rank a group of q/k heads and their v heads, and nothing here changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.models.context import ForwardContext
from tandem.models.delta_rule import chunked_delta_rule, l2_normalize, recurrent_delta_rule


class GatedRMSNorm(nn.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)) * silu(z): the norm in float32, rounded to x's dtype
    before w (plain w, not 1 + w), the gate in float32 (HF's Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        s = config.deltanet
        if s is None:
            raise ValueError("a Gated DeltaNet layer needs the config's DeltaNetSpec")
        self.layer_idx = layer_idx
        self.n_k_heads, self.n_v_heads = s.num_key_heads, s.num_value_heads
        self.dk, self.dv, self.kernel = s.key_head_dim, s.value_head_dim, s.conv_kernel
        self.v_tiled, self.a_log = s.v_tiled, s.a_log  # how the weights are stored
        D = config.hidden_size
        C = s.conv_dim
        self.in_proj_qkv = nn.Linear(D, C, bias=False)
        self.in_proj_z = nn.Linear(D, s.num_value_heads * s.value_head_dim, bias=False)
        self.in_proj_b = nn.Linear(D, s.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(D, s.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(C, C, s.conv_kernel, groups=C, bias=False)  # weight (C, 1, K)
        self.dt_bias = nn.Parameter(torch.ones(s.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_value_heads))
        self.norm = GatedRMSNorm(s.value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(s.num_value_heads * s.value_head_dim, D, bias=False)

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.dk + self.n_v_heads * self.dv

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x (B, T, D) or flattened (B*T, D) -> the same shape."""
        B, T = ctx.positions.shape
        Hk, Hv, dk, dv = self.n_k_heads, self.n_v_heads, self.dk, self.dv
        h = x.reshape(B, T, x.shape[-1])
        conv_prev, state = self.read_state(ctx, h)
        window = torch.cat(
            [conv_prev, self.in_proj_qkv(h).transpose(1, 2)], dim=-1
        )  # (B, C, K-1+T)
        if T == 1:  # decode: one output per channel, the window times its K taps
            mixed = F.silu((window * self.conv1d.weight[:, 0]).sum(-1, keepdim=True))  # (B, C, 1)
        else:
            mixed = F.silu(
                F.conv1d(window, self.conv1d.weight, groups=window.shape[1])
            )  # (B, C, T)
        q, k, v = mixed.transpose(1, 2).split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q = l2_normalize(q.reshape(B, T, Hk, dk).float()) * dk**-0.5
        k = l2_normalize(k.reshape(B, T, Hk, dk).float())
        q, k = self.expand(q).transpose(1, 2), self.expand(k).transpose(1, 2)  # (B, Hv, T, dk)
        v = v.reshape(B, T, Hv, dv).float().transpose(1, 2)  # (B, Hv, T, dv)
        beta = torch.sigmoid(self.in_proj_b(h).float())  # (B, T, Hv)
        a = -self.A_log.float().exp() if self.a_log else self.A_log.float()  # A < 0, (Hv,)
        g = a * F.softplus(self.in_proj_a(h).float() + self.dt_bias.float())
        valid = self.valid_tokens(ctx, h.device)
        if valid is not None:  # padded tokens leave the state alone (module docstring)
            beta, g = beta * valid[..., None], g * valid[..., None]
        beta, g = beta.transpose(1, 2), g.transpose(1, 2)  # (B, Hv, T)
        rule = recurrent_delta_rule if T == 1 else chunked_delta_rule
        o, state = rule(q, k, v, g, beta, state)  # (B, Hv, T, dv), (B, Hv, dk, dv)
        self.write_state(ctx, window, state)
        z = self.in_proj_z(h).reshape(B, T, Hv, dv)
        y = self.norm(o.transpose(1, 2).to(h.dtype), z)  # (B, T, Hv, dv)
        return self.out_proj(y.reshape(B, T, Hv * dv)).reshape(*x.shape[:-1], -1)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """q or k (B, T, Hk, dk) -> (B, T, Hv, dk): each q/k head to the v heads it serves,
        grouped (HF: v head j <- j // r) or tiled (GGUF: v head j <- j % Hk), r = Hv / Hk."""
        rep = self.n_v_heads // self.n_k_heads
        return x.repeat(1, 1, rep, 1) if self.v_tiled else x.repeat_interleave(rep, dim=2)

    @staticmethod
    def valid_tokens(ctx: ForwardContext, device: torch.device) -> torch.Tensor | None:
        """(B, T) float, 1 at a row's real tokens, 0 at its padding; None without padding."""
        T = ctx.positions.shape[1]
        if all(n == T for n in ctx.lengths):
            return None
        lengths = torch.tensor(ctx.lengths, device=device)
        return (torch.arange(T, device=device)[None, :] < lengths[:, None]).float()

    def read_state(self, ctx: ForwardContext, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's conv window (B, C, K-1) in h's dtype and recurrent state (B, Hv, dk, dv)
        float32: its slot's, or zeros for a row from position 0 or a step without a cache."""
        B = h.shape[0]
        conv = torch.zeros(B, self.conv_channels, self.kernel - 1, dtype=h.dtype, device=h.device)
        state = torch.zeros(B, self.n_v_heads, self.dk, self.dv, device=h.device)
        cache = ctx.cache
        if cache is None or ctx.writes is None or all(s == 0 for s in ctx.start_pos):
            return conv, state
        slots = ctx.writes.slots
        held_conv = cache.conv[self.layer_idx].index_select(0, slots).to(h.dtype)
        held_state = cache.ssm[self.layer_idx].index_select(0, slots)
        if all(s > 0 for s in ctx.start_pos):  # every row continues (decode)
            return held_conv, held_state
        cont = torch.tensor([s > 0 for s in ctx.start_pos], device=h.device)  # (B,)
        conv = torch.where(cont[:, None, None], held_conv, conv)
        state = torch.where(cont[:, None, None, None], held_state, state)
        return conv, state

    def write_state(self, ctx: ForwardContext, window: torch.Tensor, state: torch.Tensor) -> None:
        """Keeps each row's last K-1 conv inputs up to its last real token, and its state, in
        its slot (nothing without a cache)."""
        cache = ctx.cache
        if cache is None or ctx.writes is None:
            return
        B, C, _ = window.shape
        lengths = torch.tensor(ctx.lengths, device=window.device)
        idx = lengths[:, None] + torch.arange(self.kernel - 1, device=window.device)  # (B, K-1)
        last = window.gather(2, idx[:, None, :].expand(B, C, self.kernel - 1))
        slots = ctx.writes.slots
        held = cache.conv[self.layer_idx]
        held.index_copy_(0, slots, last.to(held.dtype))
        cache.ssm[self.layer_idx].index_copy_(0, slots, state.to(torch.float32))
