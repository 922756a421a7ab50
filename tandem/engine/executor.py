"""The seam between the head's generation loop and whatever runs the forward pass.

A single-device model, a tensor-parallel group and a pipeline of stages all implement `Executor`.
The head owns tokenization, scheduling and sampling; an executor only turns a `Step` into the
last-position logits of each sequence in it, and keeps each sequence's KV cache between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class StepSequence:
    """New tokens for one sequence: a prefill chunk, or one decode token.

    `start_pos` is the position of `token_ids[0]`, which equals the number of this sequence's tokens
    already in the executor's KV cache.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int


@dataclass(frozen=True)
class Step:
    """One forward pass over a batch of sequences of possibly different lengths and positions.

    `greedy`: every sequence takes the argmax, so `run` returns the chosen token ids (B,) int64
    instead of the logits. A tensor-parallel group then sends the head one (max, index) pair per
    rank and row instead of each rank's logit slice (the largest transfer of a decode step)."""

    sequences: tuple[StepSequence, ...]
    greedy: bool = False


class Executor(Protocol):
    vocab_size: int
    max_seq_len: int
    max_batch: int

    def run(self, step: Step) -> torch.Tensor:
        """Logits at each sequence's last new token, float32 on the host: (B, vocab_size); for
        a `greedy` step, the argmax of each row instead: (B,) int64 on the host (ties go to the
        lowest token id, as `torch.argmax` of the full row)."""
        ...

    def release(self, seq_ids: list[int]) -> None:
        """Frees the KV cache of finished sequences (on every rank and stage)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Who runs what, as a plain JSON-ready dict (`tandem.engine.cluster_info`): the layout,
        the state (forming, whole, re-forming, failed), each rank's host, device, dtype, weight
        format, shard, work share and memory, the links, and the head's cumulative wait and wire
        counters. Cheap (no collective, nothing on the wire) and safe to call from any thread."""
        ...

    def close(self) -> None: ...
