"""Times one greedy generation through any `Executor`: TTFT, prefill and decode speed.

The loop is the head's: one prefill step with the whole prompt, then one decode step per token,
argmax on the head. `on_phase` is called at the phase boundaries ("decode_start", "decode_end") so
a caller can read the network's byte counters exactly around the decode phase.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.executor import Executor, Step, StepSequence


@dataclass(frozen=True)
class GenerationTiming:
    prompt_tokens: int
    decode_tokens: int
    ttft_s: float  # prefill step + first argmax
    decode_s_per_token: float  # median decode step (robust to a shared machine's hiccups)
    decode_mean_s: float
    token_ids: tuple[int, ...]

    @property
    def prefill_tok_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_per_s(self) -> float:
        return 1.0 / self.decode_s_per_token


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt of `n` ids in `[1, vocab)` (the same on every run)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def time_greedy(
    executor: Executor,
    prompt: list[int],
    n_decode: int,
    seq_id: int = 0,
    on_phase: Callable[[str], None] | None = None,
) -> GenerationTiming:
    """Generates `n_decode` tokens after the first (EOS ignored) and releases the sequence."""
    if not prompt or n_decode < 1:
        raise ValueError("need a non-empty prompt and at least one decode token")
    t0 = time.perf_counter()
    ids = executor.run(Step((StepSequence(seq_id, tuple(prompt), 0),), greedy=True)).ids()
    tok = int(ids[0])
    ttft = time.perf_counter() - t0
    out, pos, steps = [tok], len(prompt), []
    if on_phase:
        on_phase("decode_start")
    for _ in range(n_decode):
        t = time.perf_counter()
        ids = executor.run(Step((StepSequence(seq_id, (tok,), pos),), greedy=True)).ids()
        tok = int(ids[0])
        steps.append(time.perf_counter() - t)
        out.append(tok)
        pos += 1
    if on_phase:
        on_phase("decode_end")
    executor.release([seq_id])
    return GenerationTiming(
        prompt_tokens=len(prompt),
        decode_tokens=n_decode,
        ttft_s=ttft,
        decode_s_per_token=statistics.median(steps),
        decode_mean_s=sum(steps) / len(steps),
        token_ids=tuple(out),
    )
