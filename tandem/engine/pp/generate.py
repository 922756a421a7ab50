"""The generation loop for a pipeline: one group of sequences in flight per stage.

A synchronous step leaves M-1 of M stages idle at any moment. Here the prompts are cut into `groups`
contiguous groups (default: one per stage) that advance independently: each group's step is
submitted as soon as its previous logits are sampled, and results come back in submission order, so
while stage 1 runs group 0's token, the head runs stage 0 for group 1, and so on. Each group's
tokens are exactly what `tandem.engine.generate.generate` would produce for it (same sampling, same
per-prompt generators); only the interleaving of the groups differs.

    time ->   head: g0 g1 | LM g0, g0' | LM g1, g1' | ...
           stage 1:    g0 | g1         | g0'        | ...
"""

from __future__ import annotations

import time
from collections import deque

from tandem.engine.executor import Step, StepSequence
from tandem.engine.generate import GenerationResult, accept_token, decode_step
from tandem.engine.pp.head import PipelineExecutor, split_microbatches
from tandem.engine.sampling_params import SamplingParams, make_generator


def generate_pipelined(
    executor: PipelineExecutor,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    groups: int | None = None,
    first_seq_id: int = 0,
) -> list[GenerationResult]:
    """Generates for every prompt, `groups` groups in flight (see the module docstring)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    results = [GenerationResult(list(p)) for p in prompts]
    gens = [
        make_generator(None if params.seed is None else params.seed + i)
        for i in range(len(prompts))
    ]
    ids = [first_seq_id + i for i in range(len(prompts))]
    stop = set(params.stop_token_ids)
    index = {sid: i for i, sid in enumerate(ids)}
    members = split_microbatches(
        [StepSequence(ids[i], tuple(p), 0) for i, p in enumerate(prompts)],
        groups or executor.num_stages,
    )
    t0 = time.perf_counter()
    inflight: deque[list[int]] = deque()
    live: set[int] = set()
    try:
        for g in members:
            executor.submit(Step(g))
            rows = [index[s.seq_id] for s in g]
            inflight.append(rows)
            live.update(rows)
        while inflight:
            rows = inflight.popleft()
            _, result = executor.collect()
            now = time.perf_counter()
            still = []
            for k, i in enumerate(rows):
                tok = result.pick(k, params, gens[i])
                if accept_token(results[i], tok, now - t0, stop, params.max_tokens):
                    still.append(i)
            done = [ids[i] for i in rows if i not in still]
            if done:
                executor.release(done)
                live.difference_update(i for i in rows if i not in still)
            if still:
                executor.submit(decode_step(ids, prompts, results, still))
                inflight.append(still)
    except BaseException:
        if live:
            try:
                executor.release([ids[i] for i in live])
            except Exception:  # noqa: BLE001 - the pipeline already failed; that error is raised
                pass
        raise
    return results
