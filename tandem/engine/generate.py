"""The one generation loop over any `Executor`: one batched prefill of every prompt, then one decode
step per token for the sequences still running; over a pipeline, optionally one group of sequences
in flight per stage. Sampling stays here, on the head."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.executor import (
    Executor,
    Pipelined,
    Step,
    StepResult,
    StepSequence,
    split_microbatches,
)
from tandem.engine.logits_process import SequenceSampler
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


class _Lockstep:
    """An executor without a pipeline behind `submit`/`collect`: `submit` runs the step at once."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._done: deque[StepResult] = deque()

    def submit(self, step: Step) -> None:
        self._done.append(self.executor.run(step))

    def collect(self) -> StepResult:
        return self._done.popleft()


def _collect_from(executor: Pipelined) -> Callable[[], StepResult]:
    return lambda: executor.collect()[1]


def generate(
    executor: Executor,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    on_token: Callable[[int, int], None] | None = None,
    first_seq_id: int = 0,
    groups: int | None = None,
) -> list[GenerationResult]:
    """Generates for every prompt; `on_token(row, token_id)` sees each token as sampled. A sequence
    stops at `params.max_tokens` or at one of `params.stop_token_ids` (kept in its ids).

    `groups`: over a `Pipelined` executor, the prompts are cut into that many contiguous groups
    (`split_microbatches`) that advance independently, each group's next step submitted as soon as
    its previous result is sampled (results come back in submission order), so with one group per
    stage every stage works on a different group at once. Otherwise (None, or an executor that is
    not `Pipelined`) all prompts go as one group: one batched prefill, then one decode step per
    token for the sequences still running. A group's tokens do not depend on the grouping (each
    prompt samples with its own generator)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    results = [GenerationResult(list(p)) for p in prompts]
    samplers = [
        SequenceSampler(
            params, p, generator=make_generator(None if params.seed is None else params.seed + i)
        )
        for i, p in enumerate(prompts)
    ]
    ids = [first_seq_id + i for i in range(len(prompts))]
    stop = set(params.stop_token_ids)
    greedy = not samplers[0].needs_logits  # the executor may return argmax ids, not logits
    if groups is not None and isinstance(executor, Pipelined):
        submit, collect = executor.submit, _collect_from(executor)
    else:
        lockstep = _Lockstep(executor)
        submit, collect, groups = lockstep.submit, lockstep.collect, 1
    prefill = [StepSequence(ids[i], tuple(p), 0) for i, p in enumerate(prompts)]
    index = {sid: i for i, sid in enumerate(ids)}
    t0 = time.perf_counter()
    inflight: deque[list[int]] = deque()  # each step in flight: its rows, in submission order
    live: set[int] = set()
    try:
        for g in split_microbatches(prefill, groups):
            rows = [index[s.seq_id] for s in g]
            live.update(rows)
            submit(Step(g, greedy))
            inflight.append(rows)
        while inflight:
            rows = inflight.popleft()
            result = collect()  # one row per sequence of that step
            now = time.perf_counter()
            still = []
            for k, i in enumerate(rows):
                tok, _ = samplers[i].choose(result, k)
                if on_token is not None:
                    on_token(i, tok)
                if accept_token(results[i], tok, now - t0, stop, params.max_tokens):
                    still.append(i)
            done = [i for i in rows if i not in still]
            if done:
                executor.release([ids[i] for i in done])
                live.difference_update(done)
            if still:
                submit(decode_step(ids, prompts, results, still, greedy))
                inflight.append(still)
    except BaseException:
        if live:
            try:
                executor.release([ids[i] for i in live])
            except Exception:  # noqa: BLE001 - the executor already failed; that error is raised
                pass
        raise
    return results
