"""Rotary tables for the torch-free path: `models/rope.py`'s inverse frequencies (default, llama3,
linear, a GGUF's per-frequency divisors) computed the same way in float32 numpy, and the cos /
signed-sin rows the native `norm_rope` and decode calls take.

numpy's float32 `pow` may differ from torch's in the last bit for some (theta, head_dim), so the
frequencies agree with the reference within 2 ulp rather than bit for bit
(tests/unit/test_lean_model.py)."""

from __future__ import annotations

import math

import numpy as np

from tandem.config import ModelConfig


def inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies, float32 (head_dim // 2,), as `models.rope.rope_inv_freq`."""
    dim = config.head_dim
    f32 = np.float32
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    inv = f32(1.0) / (f32(config.rope_theta) ** exponents)
    if config.rope_freq_factors is not None:
        return inv / np.asarray(config.rope_freq_factors, dtype=f32)
    s = config.rope_scaling
    if s is None or s.rope_type == "default":
        return inv
    if s.rope_type == "linear":
        return inv / f32(s.factor)
    if s.rope_type != "llama3":
        raise ValueError(f"rope scaling {s.rope_type!r} (the torch path runs it)")
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = f32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / f32(s.factor), inv)
    smooth = (f32(s.original_max_position_embeddings) / wavelen - f32(s.low_freq_factor)) / f32(
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (f32(1) - smooth) * scaled / f32(s.factor) + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(f32)


def cos_sin(
    inv: np.ndarray, positions: np.ndarray, pairs: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """positions (N,) -> cos, signed sin, each (N, head_dim) float32 contiguous: the angle
    `position * inv_freq` in float32, cos and sin repeated over both halves, sin's first half
    negated (rope.RotaryEmbedding's form). With `pairs`, the same columns in llama.cpp's pair
    order (HF column j at 2j, j + hd/2 at 2j + 1), for q/k rows stored in that order."""
    freqs = positions.astype(np.float32)[:, None] * inv[None, :]  # (N, hd/2)
    c, s = np.cos(freqs), np.sin(freqs)
    if pairs:  # (N, hd/2, 2) -> (N, hd)
        return np.repeat(c, 2, axis=1), np.stack((-s, s), axis=2).reshape(len(c), -1)
    return np.concatenate((c, c), axis=1), np.concatenate((-s, s), axis=1)
