"""The generation loop for a pipeline: one group of sequences in flight per stage.

A synchronous step leaves M-1 of M stages idle at any moment. Here the prompts are cut into `groups`
contiguous groups (default: one per stage) that advance independently: each group's step is
submitted as soon as its previous logits are sampled, and results come back in submission order, so
while stage 1 runs group 0's token, the head runs stage 0 for group 1, and so on. Each group's
tokens are exactly what a single group would produce for it (same sampling, same per-prompt
generators); only the interleaving of the groups differs. It is the one loop
(`tandem.engine.generate.generate`) with `groups` set.

    time ->   head: g0 g1 | LM g0, g0' | LM g1, g1' | ...
           stage 1:    g0 | g1         | g0'        | ...
"""

from __future__ import annotations

from tandem.engine.executor import Executor, Pipelined
from tandem.engine.generate import GenerationResult, generate
from tandem.engine.sampling_params import SamplingParams


def generate_pipelined(
    executor: Executor,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    groups: int | None = None,
    first_seq_id: int = 0,
) -> list[GenerationResult]:
    """Generates for every prompt over a `Pipelined` executor, `groups` groups in flight
    (default: one per stage)."""
    if not isinstance(executor, Pipelined):
        raise TypeError(f"{type(executor).__name__} keeps one step in flight; use generate")
    return generate(
        executor,
        prompts,
        params,
        groups=groups or executor.num_stages,
        first_seq_id=first_seq_id,
    )
