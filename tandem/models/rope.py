"""Rotary position embedding: default RoPE, Llama 3.1's `llama3` frequency scaling, `linear`
scaling (positions divided by a factor), YaRN (gpt-oss: frequencies blended between interpolated
and extrapolated over a ramp of dimensions, and cos/sin scaled by an attention factor), Phi-3's
`longrope` (per-frequency divisors, a short set and a long one, and an attention factor), and
llama.cpp's explicit per-frequency divisors (a GGUF's `rope_freqs` tensor,
`ModelConfig.rope_freq_factors`); and a second, unscaled table of base `rope_local_theta` for the
windowed layers of a model that states one (Gemma 3's local layers).

Partial rotary (`ModelConfig.rotary_dim` r < head_dim): the tables are r wide, dims [0, r) of
each head rotate (element i pairs with i + r/2), dims [r, head_dim) pass through unchanged.

longrope picks its factor set per row of a step: the long set when the row's sequence holds more
than `original_max_position_embeddings` tokens after the step (`ends`), for every position of it.
transformers recomputes the whole sequence when it crosses that length; the head executors do
the same (`engine.rope_rewind`), so a KV cache never mixes the two sets.

Matches Hugging Face `transformers` bit for bit in float32: inverse frequencies and the angle
`position * inv_freq` are computed in float32, then cos/sin are cast to the compute dtype.
"""

from __future__ import annotations

import math

import torch

from tandem.config import ModelConfig


def plain_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """1 / theta^(2i / dim), float32, shape (dim // 2,)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies, float32, shape (rotary_dim // 2,); `long`: longrope's long set."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = plain_inv_freq(config.rope_theta, dim)
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
        return inv_freq / factors
    s = config.rope_scaling
    if s is None or s.rope_type == "default":
        return inv_freq
    if s.rope_type == "longrope":  # transformers' _compute_longrope_parameters, op for op
        ext = torch.tensor(
            s.long_factor if long else s.short_factor, dtype=torch.float32, device="cpu"
        )
        return 1.0 / (ext * config.rope_theta**exponents)
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "yarn":
        return _yarn(config.rope_theta**exponents, s, config.rope_theta, dim)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, s, base: float, dim: int) -> torch.Tensor:
    """YaRN's blend (transformers' `_compute_yarn_parameters`): dimension pairs rotating fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`), more than
    `beta_fast` times extrapolated (kept), a linear ramp between. `pos_freqs` = base^(2i/dim)."""

    def correction_dim(rotations: float) -> float:
        orig = s.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # the extrapolated share of each pair
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    s = config.rope_scaling
    return s.attention_factor if s is not None and s.rope_type in ("yarn", "longrope") else 1.0


def longrope_switch(config: ModelConfig) -> int | None:
    """The sequence length past which longrope takes its long set (None: one set only)."""
    s = config.rope_scaling
    return (
        s.original_max_position_embeddings if s is not None and s.rope_type == "longrope" else None
    )


class RotaryEmbedding:
    """Computes cos/sin for absolute positions. Not an nn.Module on purpose: `model.to(bfloat16)`
    must not round the float32 inverse frequencies.

    Returns `sin` with its first half negated, so that `apply_rope` needs one `roll` instead of
    slicing, negating and concatenating: rotate_half(x) * sin == roll(x, half) * [-s, s].
    """

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.switch = longrope_switch(config)
        self.inv_long = rope_inv_freq(config, long=True) if self.switch is not None else None
        self.scale = attention_factor(config)
        self.local_inv_freq = None  # the windowed layers' own table (`rope_local_theta`)
        if config.rope_local_theta is not None:
            self.local_inv_freq = plain_inv_freq(config.rope_local_theta, config.rotary_dim)
        self._on: dict[tuple[torch.device, str], torch.Tensor] = {}

    def _inv(self, device: torch.device, which: str) -> torch.Tensor:
        inv = self._on.get((device, which))
        if inv is None:
            table = {"short": self.inv_freq, "long": self.inv_long, "local": self.local_inv_freq}
            inv = self._on[(device, which)] = table[which].to(device)
        return inv

    def is_long(self, end: int) -> bool:
        """Whether a sequence of `end` tokens rotates by longrope's long set."""
        return self.switch is not None and end > self.switch

    def __call__(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        ends: list[int] | None = None,
        local: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int64 -> cos, signed sin each (B, T, 1, rotary_dim) in `dtype`.
        `ends[b]`: row b's sequence length after this step (longrope's choice of set); `local`:
        the windowed layers' table (unscaled)."""
        if local:
            inv = self._inv(positions.device, "local")
        else:
            inv = self._inv(positions.device, "short")
            if self.switch is not None and ends is not None and any(map(self.is_long, ends)):
                longs = torch.tensor([self.is_long(e) for e in ends], device=positions.device)
                inv = torch.where(longs[:, None, None], self._inv(positions.device, "long"), inv)
        freqs = positions[..., None].float() * inv  # (B, T, rotary_dim/2)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0 and not local:
            cos, sin = cos * self.scale, sin * self.scale
        cos = torch.cat((cos, cos), dim=-1)  # (B, T, rotary_dim)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype)[:, :, None, :], sin.to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) rotated by position; of the first r = cos.shape[-1] dims (all of them
    unless the rotary is partial), element i pairs with i + r/2 (HF's rotate_half convention),
    the rest pass through. `sin` is the signed sin from RotaryEmbedding."""
    r = cos.shape[-1]
    if r != x.shape[-1]:
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + torch.roll(rot, r // 2, dims=-1) * sin, rest), dim=-1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
