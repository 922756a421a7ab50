"""Per-request sampling parameters and the draw of one token from one row of logits.

Each request owns a `numpy.random.Generator` (PCG64) seeded from its `seed` (and, for the n
choices of one request, its `choice`), so the token it draws at step k depends only on its own
logits and its own seed, never on which other requests shared the step. Sampling runs on numpy and
never imports torch: a row of logits may be a numpy array or a torch CPU tensor (read through the
array protocol, without a copy for float32). What changes a row before the draw (a token mask,
`logit_bias`, the penalties) and the logprobs read from it are `tandem.engine.logits_process`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# Below this a temperature is greedy (as vLLM does): logits / 1e-40 overflow to inf, and a
# softmax over infinities is NaN.
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # a request's seed: any int64 or uint64
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's frequency_penalty / presence_penalty
REPETITION_PENALTY_MAX = 100.0
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's, added to the logit
MAX_LOGPROBS = 20  # OpenAI's top_logprobs


class SamplingParamsError(ValueError):
    """A sampling parameter outside its valid range."""


class SamplingError(ValueError):
    """A row of logits no token can be drawn from (NaN, +inf, or every logit -inf)."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1.0 and min_p 0.0 disable those filters; penalties
    of 0 (repetition 1.0) and no `logit_bias` leave the logits as they are.

    `frequency_penalty` / `presence_penalty` (OpenAI's): subtracted from the logit of each token
    the output holds, times its count / once. `repetition_penalty` (transformers', llama.cpp's):
    the logit of each token among the last `repetition_window` tokens of prompt + output (0: all of
    them) divided by it where positive, multiplied by it where negative. `logit_bias`: (token id,
    bias) pairs added to the logits (-inf: the token is never drawn, llama.cpp's `false`). `logprobs`: None, or how many of the most likely tokens to
    report beside the chosen one (0..20). `choice`: which of the n choices of one request this is;
    each draws from its own stream of the same seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    choice: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the sequence's tokens (then its history is kept)."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the logits before the draw (a penalty or a bias)."""
        return self.penalized or bool(self.logit_bias)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:  # NaN fails this too
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0 or math.isnan(self.top_p):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        lo, hi = SEED_RANGE
        if self.seed is not None and not lo <= self.seed <= hi:
            raise SamplingParamsError(f"seed must be in [{lo}, {hi}], got {self.seed}")
        lo, hi = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            if not lo <= getattr(self, name) <= hi:
                raise SamplingParamsError(
                    f"{name} must be in [{lo}, {hi}], got {getattr(self, name)}"
                )
        if not 0.0 < self.repetition_penalty <= REPETITION_PENALTY_MAX:
            raise SamplingParamsError(
                f"repetition_penalty must be in (0, {REPETITION_PENALTY_MAX}], "
                f"got {self.repetition_penalty}"
            )
        if self.repetition_window < 0:
            raise SamplingParamsError(
                f"repetition_window must be >= 0, got {self.repetition_window}"
            )
        lo, hi = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias:
            if token < 0 or not (lo <= bias <= hi or bias == -math.inf):
                raise SamplingParamsError(
                    f"logit_bias {{{token}: {bias}}}: ids are >= 0, biases in [{lo}, {hi}] or -inf"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.choice < 0:
            raise SamplingParamsError(f"choice must be >= 0, got {self.choice}")


def numpy_seed(seed: int) -> int:
    """`seed` as a non-negative numpy seed, one-to-one over all ints: 0.. stay as they are, -1,
    -2, .. go to 2**64, 2**64 + 1, .. (past every uint64, so no two seeds of SEED_RANGE meet)."""
    return seed if seed >= 0 else (1 << 64) - 1 - seed


def make_generator(seed: int | None, choice: int = 0) -> np.random.Generator:
    """A PCG64 generator seeded from `seed` (`numpy_seed`); None: from the OS's entropy (numpy's
    own seeding). Choice 0 is the seed's own stream; choice i > 0 the seed's i-th spawned one
    (`SeedSequence(spawn_key=(i,))`: independent of every other seed's and choice's)."""
    if choice == 0:
        return np.random.Generator(np.random.PCG64(None if seed is None else numpy_seed(seed)))
    entropy = None if seed is None else numpy_seed(seed)
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(entropy, spawn_key=(choice,)))
    )


def sample_next(logits: Any, params: SamplingParams, generator: np.random.Generator) -> int:
    """One token id from `logits` (vocab,), a float numpy array or torch CPU tensor; a 0-d integer
    is a token the executor already chose (a greedy step) and is returned as it is. The row is
    drawn from as it is (`sample_row`): no mask, bias or penalty."""
    if np.ndim(logits) == 0 and not is_floating(logits):
        return int(logits)
    return sample_row(float_row(logits), params, generator)


def float_row(logits: Any) -> np.ndarray:
    """A row of logits as a float32 numpy array (a view where it already is one)."""
    as_float = getattr(logits, "float", None)  # a torch tensor in another float dtype: float32
    return np.asarray(as_float() if callable(as_float) else logits, dtype=np.float32)


def sample_row(row: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    """One token id from `row` (vocab,), float32 or float64 (a row already masked, biased and
    penalized: `tandem.engine.logits_process`): greedy takes the argmax (ties to the lowest id),
    else one uniform number from `generator` draws from `draw_probs`."""
    if params.greedy:
        return int(np.argmax(row))
    ids, w, _ = _kept(row, params)
    return _draw(ids, w, generator)


def draw_probs(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The weights a non-greedy draw from `row` uses, float64, 0 for every token it cannot take
    (they sum to 1 before `top_p`, and to the kept mass after it).

    The logits, as float32, are divided by the temperature; `top_k` keeps the logits >= the k-th
    largest; the weights are exp(logit - the top logit) in float32 (the top token's is 1); `min_p`
    keeps the tokens whose weight is at least `min_p`; `top_p` keeps the smallest prefix of what
    is left by descending weight (ties by id) whose mass reaches `top_p` of the total, at least
    the top token (vLLM's order). Masses (the total, the prefix sums) are float64 sums of the
    float32 weights; the weights are divided by the total last. A logit more than ~103 under the
    top one (a probability under 1e-45) gets weight 0 in float32. The float32 softmax is ~8x
    cheaper than a float64 one on a 49k-token row (numpy's float32 exp is vectorized) and its
    error, a few float32 ulps per weight, is far below any probability a draw can tell apart.
    `SamplingError` for logits no token can be drawn from."""
    ids, w, total = _kept(row, params)
    out = np.zeros(row.shape[-1], np.float64)
    if ids is None:
        np.divide(w, total, out=out, dtype=np.float64)
    else:
        out[ids] = np.divide(w, total, dtype=np.float64)
    return out


def _kept(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray, float]:
    """`draw_probs` unnormalized, as (ids, their float32 weights, the total mass before
    `top_p`): the ids ascending where `top_k` or `top_p` keeps a subset, else (None, the weights
    of every id). The (vocab,) row is copied once, as float32; under `top_k` only the kept
    logits go on to the softmax (the others' weights are 0)."""
    w = np.divide(row, np.float32(params.temperature), dtype=np.float32)  # (vocab,), the one copy
    top = w.max()  # NaN where any logit is NaN
    if not np.isfinite(top):
        raise SamplingError(f"cannot sample from logits whose maximum is {top}")
    n = w.shape[-1]
    ids = None
    if 0 < params.top_k < n:
        kth = np.partition(w, n - params.top_k)[n - params.top_k]
        ids = np.flatnonzero(w >= kth)  # the k largest and every tie of the k-th: (k',)
        w = w[ids]
    np.exp(np.subtract(w, top, out=w), out=w)  # the top token's is 1
    if params.min_p > 0.0:
        w[w < np.float32(params.min_p)] = 0.0
    total = float(w.sum(dtype=np.float64))
    if params.top_p < 1.0:
        sub = _top_p_ids(w, params.top_p * total)
        return (sub if ids is None else ids[sub]), w[sub], total
    return ids, w, total


TOP_P_FLOORS = (1e-3, 1e-5, 1e-7)  # first candidates: the weights >= each (the top's is 1)
TOP_P_CANDIDATES = (1024, 16384, 65536)  # then the m largest: a full sort of 150k ids ~25 ms


def _top_p_ids(w: np.ndarray, mass: float) -> np.ndarray:
    """The smallest prefix of tokens by descending weight (ties by id) whose float64 running sum
    reaches `mass` (always at least the top token), as ids ascending.

    Sorts only a candidate set once its mass reaches `mass`: the tokens of weight >= some
    threshold, so every token outside it weighs less than every token in it and the prefix lies
    among them, in the order a full sort gives. The thresholds: each of `TOP_P_FLOORS` in turn
    (one compare pass over the row each, ~15 us on 49k ids; a peaked row needs the first, a
    flatter one a lower: thousands of candidates, which `_by_weight` sorts in ~15 us per 3000);
    past them the nonzero tokens at or above the m-th largest weight (m in `TOP_P_CANDIDATES`,
    every tie of it included; a partition, ~300 us on 49k ids), else all tokens."""
    ids = None
    for floor in TOP_P_FLOORS:
        above = np.flatnonzero(w >= np.float32(floor))
        if w[above].sum(dtype=np.float64) >= mass:
            ids = above
            break
    if ids is None:
        for m in TOP_P_CANDIDATES:
            if len(w) <= m:
                break
            cut = np.partition(w, len(w) - m)[len(w) - m]
            above = np.flatnonzero((w >= cut) & (w > 0))
            if w[above].sum(dtype=np.float64) >= mass:
                ids = above
                break
        if ids is None:
            ids = np.arange(len(w))
    order = _by_weight(w, ids)
    sorted_w = w[order].astype(np.float64)
    return np.sort(order[np.cumsum(sorted_w) - sorted_w < mass])


def _by_weight(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`ids` (ascending) by descending w[ids], ties by id: the order of a stable argsort of
    -w[ids]. For float32 weights >= 0 (their bits order as the values do) one int64 sort of the
    keys (~bits << 32) | id, ascending: descending bits, then ascending id (~7x a stable argsort
    of 3000 floats, numpy's SIMD sort)."""
    if w.dtype != np.float32 or len(w) >= 1 << 31:
        return ids[np.argsort(-w[ids], kind="stable")]
    keys = (~w[ids].view(np.int32)).astype(np.int64) << 32
    keys |= ids
    keys.sort()
    return keys & 0xFFFFFFFF


DRAW_BLOCK = 256  # ids per block of the whole-vocabulary draw


def _draw(ids: np.ndarray | None, w: np.ndarray, generator: np.random.Generator) -> int:
    """The id whose cumulative-mass interval holds one uniform draw u * (the mass of `w`);
    zero-mass ids never. `ids` ascending with their weights `w` (None: every id).

    Over the whole vocabulary the running sums go by blocks of `DRAW_BLOCK` ids: the float64 sum
    of each block, their running sum to find the block the draw lands in, then the running sum
    inside that block (a 49k-id float64 running sum alone costs ~120 us). The block sums and the
    in-block sums differ from one long running sum only by float64 rounding (~1e-16 of the mass),
    so a draw lands in another id only within that distance of an interval's edge."""
    u = generator.random()
    if ids is not None or len(w) <= DRAW_BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        if i >= len(w):  # the draw rounded up to the total: the last id with mass
            i = int(np.flatnonzero(w)[-1])
        return i if ids is None else int(ids[i])
    starts = np.arange(0, len(w), DRAW_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))
    target = u * block_cdf[-1]
    b = int(np.searchsorted(block_cdf, target, side="right"))
    if b >= len(starts):  # rounded up to the total: the last block with mass
        b = int(np.flatnonzero(np.diff(block_cdf, prepend=0.0) > 0)[-1])
    lo = int(starts[b])
    block = w[lo : lo + DRAW_BLOCK]
    cdf = np.cumsum(block, dtype=np.float64)
    i = int(np.searchsorted(cdf, target - (block_cdf[b - 1] if b else 0.0), side="right"))
    if i >= len(block):
        i = int(np.flatnonzero(block)[-1])
    return lo + i


def is_floating(x: Any) -> bool:
    """Whether `x` (a torch tensor, numpy array or Python number) holds floats, without importing
    torch: a tensor answers `is_floating_point()`, anything else by its numpy dtype."""
    is_fp = getattr(x, "is_floating_point", None)
    if callable(is_fp):
        return bool(is_fp())
    return np.asarray(x).dtype.kind in "fc"
