"""The gated delta rule (Gated DeltaNet's token mixing), in two forms that equal each other: a
recurrent one, token by token (decode), and a chunked one, a few matrix products per chunk of C
tokens (prefill).

Per v head, with a state S (dk, dv), for each token t (q_t, k_t unit-norm, q_t scaled by dk^-1/2):

    S   <- exp(g_t) S                            g_t <= 0: the per-head decay, in log space
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T    the delta rule: write the part of v_t that S
                                                 does not already predict from k_t, at rate beta_t
    o_t  = S^T q_t

A token with g_t = 0 and beta_t = 0 leaves S as it was: that is how a step's padded tokens are
kept out of a sequence's state.

The chunked form (as flash-linear-attention's and transformers' `torch_chunk_gated_delta_rule`):
within a chunk, with cumulative decays c_i = g_1 + ... + g_i and Gamma_ij = exp(c_i - c_j) (i >= j),
the updates of its C tokens solve one unit lower-triangular system
L = I + tril(diag(beta) K K^T o Gamma, -1):  L U = diag(beta) V,  L W = diag(beta exp(c)) K; then
V' = U - W S0 (the corrections against the state entering the chunk),
O = (Q o exp(c)) S0 + tril(Q K^T o Gamma) V', and
S1 = exp(c_C) S0 + (K o exp(c_C - c))^T V'.

Everything here runs in float32, on (B, H, T, d) tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, H, T, dk), v (B, H, T, dv), g and beta (B, H, T), state (B, H, dk, dv) ->
    (o (B, H, T, dv), the state after the last token); token by token (module docstring)."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        k_t = k[:, :, t, None, :]  # (B, H, 1, dk)
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t, None, :] - k_t @ state) * beta[:, :, t, None, None]  # (B, H, 1, dv)
        state = state + k_t.transpose(-1, -2) @ delta  # the rank-1 update k delta^T
        out[:, :, t] = (q[:, :, t, None, :] @ state)[:, :, 0]
    return out, state


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_delta_rule`'s result by chunks of `chunk` tokens (module docstring)."""
    B, H, T, dk = k.shape
    pad = (chunk - T % chunk) % chunk  # zero tokens (g = beta = 0) leave the state alone
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    c = g.cumsum(dim=-1)  # (B, H, n, C)
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    gamma = (c[..., :, None] - c[..., None, :]).masked_fill(above, float("-inf")).exp()
    # (B, H, n, C, C): only its strict lower triangle is read (unitriangular: the diagonal is 1)
    system = (k_beta @ k.transpose(-1, -2)) * gamma
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * c.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * gamma  # (B, H, n, C, C), causal
    q_decayed = q * c.exp()[..., None]
    k_decayed = k * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1)
    out = torch.empty_like(v)
    for i in range(n):
        corrected = u[:, :, i] - w[:, :, i] @ state  # (B, H, C, dv)
        out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ corrected
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ corrected
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state
