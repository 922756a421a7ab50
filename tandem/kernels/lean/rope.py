"""Rotary tables for the torch-free path: `models/rope.py`'s inverse frequencies (default, llama3,
linear, YaRN, a GGUF's per-frequency divisors) computed the same way in float32 numpy, and the
cos / signed-sin rows the native `norm_rope` and decode calls take (times YaRN's attention factor,
`attention_factor`).

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
    if s.rope_type == "yarn":
        return _yarn(f32(config.rope_theta) ** exponents, s, config.rope_theta, dim)
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


def _yarn(pos_freqs: np.ndarray, s, base: float, dim: int) -> np.ndarray:
    """`models.rope._yarn` in float32: pairs rotating fewer than `beta_slow` times over the
    original context interpolated (1 / (factor base^(2i/dim))), more than `beta_fast` times kept
    (1 / base^(2i/dim)), a linear ramp between; `pos_freqs` = base^(2i/dim)."""
    f32 = np.float32

    def correction_dim(rotations: float) -> float:
        orig = s.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    keep = f32(1) - ramp  # the extrapolated share of each pair
    interpolated = f32(1.0) / (f32(s.factor) * pos_freqs)
    return (interpolated * (f32(1) - keep) + (f32(1.0) / pos_freqs) * keep).astype(f32)


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1 (`models.rope`'s)."""
    s = config.rope_scaling
    return s.attention_factor if s is not None and s.rope_type == "yarn" else 1.0


def cos_sin(
    inv: np.ndarray, positions: np.ndarray, pairs: bool = False, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """positions (N,) -> cos, signed sin, each (N, head_dim) float32 contiguous: the angle
    `position * inv_freq` in float32, cos and sin (times `scale` where it is not 1) repeated over
    both halves, sin's first half negated (rope.RotaryEmbedding's form). With `pairs`, the same
    columns in llama.cpp's pair order (HF column j at 2j, j + hd/2 at 2j + 1), for q/k rows stored
    in that order."""
    freqs = positions.astype(np.float32)[:, None] * inv[None, :]  # (N, hd/2)
    c, s = np.cos(freqs), np.sin(freqs)
    if scale != 1.0:
        c, s = c * np.float32(scale), s * np.float32(scale)
    if pairs:  # (N, hd/2, 2) -> (N, hd)
        return np.repeat(c, 2, axis=1), np.stack((-s, s), axis=2).reshape(len(c), -1)
    return np.concatenate((c, c), axis=1), np.concatenate((-s, s), axis=1)
