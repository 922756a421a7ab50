"""Per-request sampling parameters and the draw of one token from one row of logits.

Each request owns a `torch.Generator` seeded from its `seed`, so the token it draws at step k depends
only on its own logits and its own seed, never on which other requests shared the step.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

# Below this a temperature is greedy (as vLLM does): logits / 1e-40 overflow to inf, and a
# softmax over infinities is NaN.
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class SamplingParamsError(ValueError):
    """A sampling parameter outside its valid range."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:  # NaN fails this too
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0 or math.isnan(self.top_p):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0, got {self.top_k}")
        lo, hi = SEED_RANGE
        if self.seed is not None and not lo <= self.seed <= hi:
            raise SamplingParamsError(f"seed must be in [{lo}, {hi}], got {self.seed}")


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from `logits` (vocab,), float32 on the host; a 0-d integer tensor is a token
    the executor already chose (a greedy step) and is returned as it is."""
    if logits.ndim == 0 and not logits.is_floating_point():
        return int(logits)
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
