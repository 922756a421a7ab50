"""The generation loop over any `Executor`: one batched prefill of every prompt, then one decode step
per token for the sequences still running. Sampling stays here, on the head."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.executor import Executor, Step, StepSequence
from tandem.engine.sampling_params import SamplingParams, make_generator


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # or "stop"
    ttft_s: float = 0.0  # start to first sampled token (prefill of the whole batch + sampling)
    decode_s: float = 0.0  # first to last sampled token

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def accept_token(
    r: GenerationResult, tok: int, elapsed_s: float, stop: set[int], max_tokens: int
) -> bool:
    """Records a sampled token and its timing; True while the sequence should keep decoding."""
    r.token_ids.append(tok)
    if len(r.token_ids) == 1:
        r.ttft_s = elapsed_s
    else:
        r.decode_s = elapsed_s - r.ttft_s
    if tok in stop:
        r.finish_reason = "stop"
        return False
    return len(r.token_ids) < max_tokens


def decode_step(
    ids: list[int],
    prompts: list[list[int]],
    results: list[GenerationResult],
    rows: list[int],
    greedy: bool = False,
) -> Step:
    """The next step for `rows`: each feeds back its last token at the position after it."""
    return Step(
        tuple(
            StepSequence(
                ids[i],
                (results[i].token_ids[-1],),
                len(prompts[i]) + len(results[i].token_ids) - 1,
            )
            for i in rows
        ),
        greedy,
    )


def generate(
    executor: Executor,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    on_token: Callable[[int, int], None] | None = None,
    first_seq_id: int = 0,
) -> list[GenerationResult]:
    """Generates for every prompt together; `on_token(row, token_id)` sees each token as sampled.
    A sequence stops at `params.max_tokens` or at one of `params.stop_token_ids` (kept in its ids)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    results = [GenerationResult(list(p)) for p in prompts]
    gens = [
        make_generator(None if params.seed is None else params.seed + i)
        for i in range(len(prompts))
    ]
    ids = [first_seq_id + i for i in range(len(prompts))]
    stop = set(params.stop_token_ids)
    t0 = time.perf_counter()
    greedy = params.greedy  # the executor returns argmax ids, not logits
    step = Step(tuple(StepSequence(ids[i], tuple(p), 0) for i, p in enumerate(prompts)), greedy)
    running = list(range(len(prompts)))
    try:
        while running:
            result = executor.run(step)  # one row per running sequence
            now = time.perf_counter()
            still = []
            for row, i in enumerate(running):
                tok = result.pick(row, params, gens[i])
                if on_token is not None:
                    on_token(i, tok)
                if accept_token(results[i], tok, now - t0, stop, params.max_tokens):
                    still.append(i)
            done = [ids[i] for i in running if i not in still]
            if done:
                executor.release(done)
            running = still
            step = decode_step(ids, prompts, results, running, greedy)
    finally:
        if running:
            executor.release([ids[i] for i in running])
    return results
