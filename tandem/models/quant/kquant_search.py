"""The K-quant min/scale search: llama.cpp's `make_qkx2_quants` (ggml-quants.c), vectorised over
sub-blocks, for Q4_K and Q5_K.

A sub-block x of n values (n = 32) is stored as x_i ~ s * L_i - m, L_i in [0, nmax], m >= 0.
With importance weights w_i = rms(x) + |x_i|, the search starts from the plain fit
s = (max - min') / nmax, m = -min' (min' = min(min x, 0)), then for each candidate inverse step
(nmax + rmin + rdelta * k) / (max - min'), k = 0..nstep, it rounds L, solves the weighted least
squares for (s, -m) given L, clamps m >= 0 (refitting s alone), and keeps the candidate with the
smallest weighted squared error. Parameters per type are llama.cpp's: Q4_K (nmax 15) rmin -1,
rdelta 0.1, 20 steps; Q5_K (nmax 31) rmin -0.5, rdelta 0.1, 15 steps.
"""

from __future__ import annotations

import numpy as np

# bits -> (rmin, rdelta, nstep) of llama.cpp's quantize_row_q{4,5}_K_ref
SEARCH: dict[int, tuple[float, float, int]] = {4: (-1.0, 0.1, 20), 5: (-0.5, 0.1, 15)}


def search_scale_min(
    x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (M, n) float32 -> step s (M,), offset m >= 0 (M,), L (M, n) in [0, nmax] (float32)."""
    x = x.astype(np.float32, copy=False)
    w = np.sqrt((x * x).mean(axis=1, keepdims=True)) + np.abs(x)  # (M, n)
    sum_w, sum_x = w.sum(axis=1), (w * x).sum(axis=1)
    lo = np.minimum(x.min(axis=1), 0.0)  # (M,)
    span = x.max(axis=1) - lo
    flat = span == 0
    span = np.where(flat, 1.0, span).astype(np.float32)
    centred = x - lo[:, None]  # (M, n)

    def levels(inv_step: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(inv_step[:, None] * centred), 0, nmax)

    def error(s: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
        return (w * (s[:, None] * q + mn[:, None] - x) ** 2).sum(axis=1)

    s = span / nmax
    best_q = levels(nmax / span)
    best_s, best_min = s, lo
    best = error(s, lo, best_q)
    with np.errstate(divide="ignore", invalid="ignore"):
        for k in range(nstep + 1):
            q = levels((rmin + rdelta * k + nmax) / span)
            sl, sl2, sxl = (w * q).sum(axis=1), (w * q * q).sum(axis=1), (w * q * x).sum(axis=1)
            det = sum_w * sl2 - sl * sl
            s = (sum_w * sxl - sum_x * sl) / det
            mn = (sl2 * sum_x - sl * sxl) / det
            pos = mn > 0
            s = np.where(pos, sxl / sl2, s)
            mn = np.where(pos, 0.0, mn)
            cur = error(s, mn, q)
            take = (det > 0) & (cur < best)
            best_q = np.where(take[:, None], q, best_q)
            best_s, best_min = np.where(take, s, best_s), np.where(take, mn, best_min)
            best = np.where(take, cur, best)
    best_s = np.where(flat, 0.0, best_s).astype(np.float32)
    best_q = np.where(flat[:, None], 0.0, best_q).astype(np.float32)
    return best_s, (-np.where(flat, lo, best_min)).astype(np.float32), best_q
