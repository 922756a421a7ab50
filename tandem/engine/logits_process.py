"""What happens to one sequence's row of logits between the executor and the draw, on numpy.

    row (float32, the executor's)
      -> token mask      tokens a `TokenMask` does not allow this step: -inf   (structured output)
      -> logit_bias      + bias[id]
      -> repetition      x / p where x > 0, x * p elsewhere, for the ids among the last
                         `repetition_window` tokens of prompt + output (transformers, llama.cpp)
      -> frequency, presence   - count(id) * frequency - presence, for the ids in the output (OpenAI)
      => logprobs        log-softmax of this row in float64 (before the temperature, as OpenAI's)
      -> draw            temperature, top_k, min_p, top_p (`sampling_params.sample_row`)

A row no step changes is drawn from as it came (float32, no copy); any change works on a float64
copy. `SequenceSampler` holds what one sequence carries from step to step (its generator, its
token history, its mask) and is the one place the scheduler and the generation loop choose a
token. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tandem.engine.sampling_params import (
    SamplingError,
    SamplingParams,
    float_row,
    make_generator,
    sample_row,
)

if TYPE_CHECKING:
    from tandem.engine.executor import StepResult


class TokenMask(Protocol):
    """Which tokens a sequence may take at each step (a grammar's matcher, for structured output).

    `allowed()` is asked once per step before the draw: a (vocab,) bool array (True: allowed; a
    shorter array allows nothing past its end), or None when every token is allowed this step.
    `advance(token)` is told the token chosen. A mask that allows nothing fails its request."""

    def allowed(self) -> np.ndarray | None: ...

    def advance(self, token: int) -> None: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `k` most likely tokens' (most likely first,
    ties by the lower id), from one processed row (`log_softmax`, `top_logprobs`)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class TokenHistory:
    """A sequence's tokens as the penalties read them: prompt + output, and each output token's
    count, kept incrementally."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.tokens: list[int] = list(prompt_ids)
        self.counts: dict[int, int] = {}  # output tokens only

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of the distinct output tokens, int64 each."""
        ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
        counts = np.fromiter(self.counts.values(), dtype=np.int64, count=len(self.counts))
        return ids, counts

    def recent_ids(self, window: int) -> np.ndarray:
        """The distinct ids among the last `window` tokens of prompt + output (0: all)."""
        tail = self.tokens[-window:] if window > 0 else self.tokens
        return np.unique(np.asarray(tail, dtype=np.int64))


def apply_logit_bias(x: np.ndarray, ids: np.ndarray, bias: np.ndarray) -> None:
    """x[ids] += bias, in place (ids past the row's end are ignored: no such token)."""
    inside = ids < x.shape[-1]
    np.add.at(x, ids[inside], bias[inside])


def apply_penalties(x: np.ndarray, params: SamplingParams, history: TokenHistory) -> None:
    """The repetition penalty, then the frequency and presence penalties, on `x` in place."""
    n = x.shape[-1]
    p = params.repetition_penalty
    if p != 1.0:
        ids = history.recent_ids(params.repetition_window)
        ids = ids[ids < n]
        v = x[ids]
        x[ids] = np.where(v > 0, v / p, v * p)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        ids, counts = history.output_counts()
        inside = ids < n
        ids, counts = ids[inside], counts[inside]
        x[ids] -= counts * params.frequency_penalty + params.presence_penalty


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log(softmax(x)) in float64: x - max - log(sum(exp(x - max))). `SamplingError` where the
    maximum is not finite (NaN or +inf anywhere, or every logit -inf)."""
    x = np.asarray(x, dtype=np.float64)
    top = x.max()
    if not np.isfinite(top):
        raise SamplingError(f"cannot take logprobs of logits whose maximum is {top}")
    shifted = x - top
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(x: np.ndarray, lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` tokens with the largest logits `x` as (id, lp[id]), largest first, ties by the
    lower id. Ranked by `x`, not `lp`: two logits a hair apart can round to one logprob, and the
    argmax (the greedy token) must still come first."""
    n = x.shape[-1]
    k = min(k, n)
    if k <= 0:
        return ()
    kth = np.partition(x, n - k)[n - k]
    ids = np.flatnonzero(x >= kth)  # every tie of the k-th too
    order = ids[np.lexsort((ids, -x[ids]))][:k]
    return tuple((int(i), float(lp[i])) for i in order)


def _masked(row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """`row` as float64 with -inf wherever `allowed` (bool, shorter: nothing past its end) is
    False; `SamplingError` where it allows nothing. A few allowed tokens (a grammar's `{`, a
    key, an enum) are written into a row of -inf; many are copied and the rest overwritten:
    either way one pass over the row, not two."""
    n = row.shape[-1]
    keep = np.zeros(n, dtype=bool)
    m = min(len(allowed), n)
    keep[:m] = np.asarray(allowed[:m], dtype=bool)
    ids = np.flatnonzero(keep)
    if not len(ids):
        raise SamplingError("the token mask allows no token")
    if len(ids) * 8 < n:
        x = np.full(n, -np.inf)
        x[ids] = row[ids]
        return x
    x = row.astype(np.float64)
    np.copyto(x, -np.inf, where=~keep)
    return x


class SequenceSampler:
    """One sequence's choice of its next token from a step's result: its generator, its token
    history (kept only when a penalty reads it) and its token mask. `needs_logits`: whether a
    greedy step's argmax ids would not do (the step must bring this row's logits)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        mask: TokenMask | None = None,
        generator: np.random.Generator | None = None,
    ) -> None:
        self.params = params
        self.mask = mask
        self.generator = generator or make_generator(params.seed, params.choice)
        self.history = TokenHistory(prompt_ids) if params.penalized else None
        self._bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float64)

    @property
    def needs_logits(self) -> bool:
        p = self.params
        return not p.greedy or p.shapes_logits or p.logprobs is not None or self.mask is not None

    def process(self, row: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """`row` with the mask (`allowed`, else asked of the mask now), the bias and the
        penalties applied: a float64 copy, or `row` itself when none applies."""
        if allowed is None and self.mask is not None:
            allowed = self.mask.allowed()
        if allowed is None and not self.params.shapes_logits:
            return row
        if allowed is not None:
            x = _masked(row, allowed)
        else:
            x = row.astype(np.float64)
        if len(self._bias_ids):
            apply_logit_bias(x, self._bias_ids, self._bias)
        if self.history is not None:
            apply_penalties(x, self.params, self.history)
        return x

    def choose(self, result: StepResult, row: int) -> tuple[int, TokenLogprobs | None]:
        """Row `row`'s next token, and its logprobs when the params ask for them."""
        if result.token_ids is not None:
            if self.needs_logits:  # the scheduler asked for ids where this row needs logits
                raise SamplingError("a greedy step's ids where this sequence needs its logits")
            token, logprobs = int(result.token_ids[row]), None
        else:
            assert result.logits is not None
            raw = float_row(result.logits[row])
            allowed = self.mask.allowed() if self.mask is not None else None
            token = self._greedy_allowed(raw, allowed)
            if token is not None:
                self.accept(token)
                return token, None
            x = self.process(raw, allowed)
            token = sample_row(x, self.params, self.generator)
            logprobs = None
            if self.params.logprobs is not None:
                lp = log_softmax(x)
                top = top_logprobs(x, lp, self.params.logprobs)
                logprobs = TokenLogprobs(token, float(lp[token]), top)
        self.accept(token)
        return token, logprobs

    def _greedy_allowed(self, row: np.ndarray, allowed: np.ndarray | None) -> int | None:
        """The greedy choice under a mask alone (no bias, penalty or logprobs), read without
        the masked float64 copy of the row: the row's argmax t (its lowest id among ties) where
        the mask allows it, which is the masked row's argmax too (an allowed id below t would
        hold a smaller logit). None, for the whole path, where the mask rules t out or the
        logit is not finite."""
        p = self.params
        if allowed is None or not p.greedy or p.shapes_logits or p.logprobs is not None:
            return None
        t = int(np.argmax(row))
        if t < len(allowed) and allowed[t] and np.isfinite(row[t]):
            return t
        return None

    def accept(self, token: int) -> None:
        """Records `token` as this sequence's next (history and mask)."""
        if self.history is not None:
            self.history.append(token)
        if self.mask is not None:
            self.mask.advance(token)
