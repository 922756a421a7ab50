"""Rotary tables for the torch-free path: `models/rope.py`'s inverse frequencies (default, llama3,
linear, YaRN, Phi-3's longrope short and long sets, a GGUF's per-frequency divisors) computed the
same way in float32 numpy, and the cos / signed-sin rows the native `norm_rope` and decode calls
take (times YaRN's or longrope's attention factor, `attention_factor`).

Partial rotary (rotary_dim r < head_dim, Phi-3.5 / Phi-4-mini): the native calls rotate element i
of a head with element i + hd/2 (or, in `pairs` order, 2j with 2j + 1), the whole head wide. The
reference rotates HF element j with j + r/2 for j < r/2 and passes dims [r, hd) through. So the
torch-free path keeps each q/k head in `partial_order`: HF dims [0, r/2) at places [0, r/2), HF
[r/2, r) at [hd/2, hd/2 + r/2), and the pass-through dims [r, hd) in the places left, the first
half of them at [r/2, hd/2), the rest at [hd/2 + r/2, hd). `Tables` gives those places cos 1 and
sin 0 (x * 1 + y * 0 = x exactly), the rotary places the reference's angles; the scores q.k are
the same sums in another order, and v is untouched.

longrope: a row whose sequence holds more than original_max_position_embeddings tokens after the
step rotates every one of its positions by the long set, else the short one (`Tables.rows`'
`ends`), as `models.rope.RotaryEmbedding`; the executor recomputes a sequence that crosses the
switch (`engine.rope_rewind`), so a cache never mixes the two sets.

numpy's float32 `pow` may differ from torch's in the last bit for some (theta, head_dim), so the
frequencies agree with the reference within 2 ulp rather than bit for bit
(tests/unit/test_lean_model.py)."""

from __future__ import annotations

import math

import numpy as np

from tandem.config import ModelConfig


def inv_freq(config: ModelConfig, long: bool = False) -> np.ndarray:
    """Inverse frequencies, float32 (rotary_dim // 2,), as `models.rope.rope_inv_freq`; `long`:
    longrope's long set."""
    dim = config.rotary_dim
    f32 = np.float32
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    inv = f32(1.0) / (f32(config.rope_theta) ** exponents)
    if config.rope_freq_factors is not None:
        return inv / np.asarray(config.rope_freq_factors, dtype=f32)
    s = config.rope_scaling
    if s is None or s.rope_type == "default":
        return inv
    if s.rope_type == "longrope":  # 1 / (factor_i * theta^(2i / r))
        ext = np.asarray(s.long_factor if long else s.short_factor, dtype=f32)
        return (f32(1.0) / (ext * f32(config.rope_theta) ** exponents)).astype(f32)
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
    """What cos and sin are multiplied by: YaRN's or longrope's attention factor, else 1
    (`models.rope`'s)."""
    s = config.rope_scaling
    return s.attention_factor if s is not None and s.rope_type in ("yarn", "longrope") else 1.0


def partial_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """(head_dim,) int64: the HF dim of a q/k head kept at each place under partial rotary
    (module docstring); the identity when rotary_dim == head_dim."""
    hd, half, r2 = head_dim, head_dim // 2, rotary_dim // 2
    rest = np.arange(rotary_dim, hd)  # the pass-through dims, hd - r of them (even)
    first, second = rest[: half - r2], rest[half - r2 :]
    return np.concatenate((np.arange(r2), first, np.arange(r2, rotary_dim), second))


class Tables:
    """A model's cos / signed-sin rows, head_dim wide, in the order its q/k heads are kept
    (`pairs`: llama.cpp's pair order; partial rotary: `partial_order`), each row's set of
    frequencies chosen by its sequence's end (longrope; module docstring)."""

    def __init__(self, config: ModelConfig, pairs: bool = False) -> None:
        s = config.rope_scaling
        self.hd, self.r = config.head_dim, config.rotary_dim
        if pairs and self.r != self.hd:  # no architecture has both (llama pairs, phi3 partial)
            raise ValueError("partial rotary on q/k rows in llama.cpp's pair order")
        self.pairs = pairs
        self.short = inv_freq(config)
        self.switch = (
            s.original_max_position_embeddings if s is not None and s.rope_type == "longrope"
            else None
        )  # fmt: skip
        self.long = inv_freq(config, long=True) if self.switch is not None else None
        self.scale = attention_factor(config)

    def rows(
        self, positions: np.ndarray, ends: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """positions (N,) -> cos, signed sin (N, head_dim) float32; `ends` (N,): the length of
        each position's sequence after its step (longrope's choice; None: positions + 1, one
        decode token each)."""
        inv = self.short
        if self.switch is not None:
            ends = positions + 1 if ends is None else ends
            long = np.asarray(ends)[:, None] > self.switch  # (N, 1)
            inv = np.where(long, self.long[None, :], self.short[None, :])  # (N, r/2)
        if self.r == self.hd:
            return cos_sin(inv, positions, self.pairs, self.scale)
        freqs = positions.astype(np.float32)[:, None] * inv  # (N, r/2)
        c, s = np.cos(freqs), np.sin(freqs)
        if self.scale != 1.0:
            c, s = c * np.float32(self.scale), s * np.float32(self.scale)
        n, half = len(positions), self.hd // 2
        cf = np.ones((n, half), np.float32)  # the pass-through places: cos 1, sin 0
        sf = np.zeros((n, half), np.float32)
        cf[:, : self.r // 2], sf[:, : self.r // 2] = c, s
        return np.concatenate((cf, cf), axis=1), np.concatenate((-sf, sf), axis=1)


def cos_sin(
    inv: np.ndarray, positions: np.ndarray, pairs: bool = False, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """positions (N,) -> cos, signed sin, each (N, head_dim) float32 contiguous: the angle
    `position * inv_freq` in float32, cos and sin (times `scale` where it is not 1) repeated over
    both halves, sin's first half negated (rope.RotaryEmbedding's form). With `pairs`, the same
    columns in llama.cpp's pair order (HF column j at 2j, j + hd/2 at 2j + 1), for q/k rows stored
    in that order."""
    freqs = positions.astype(np.float32)[:, None] * inv  # (N, hd/2); inv (hd/2,) or per row
    c, s = np.cos(freqs), np.sin(freqs)
    if scale != 1.0:
        c, s = c * np.float32(scale), s * np.float32(scale)
    if pairs:  # (N, hd/2, 2) -> (N, hd)
        return np.repeat(c, 2, axis=1), np.stack((-s, s), axis=2).reshape(len(c), -1)
    return np.concatenate((c, c), axis=1), np.concatenate((-s, s), axis=1)
