"""The seam between the head's generation loop and whatever runs the forward pass.

A single-device model, a tensor-parallel group and a pipeline of stages all implement `Executor`.
The head owns tokenization, scheduling and sampling; an executor only turns a `Step` into a
`StepResult` at the last new position of each sequence in it (logits, or the argmax ids of a
greedy step), and keeps each sequence's KV cache between steps. An executor that can keep several
steps in flight (a pipeline) is also `Pipelined`; callers check that with `isinstance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

from tandem.engine.sampling_params import SamplingParams, is_floating, sample_next

if TYPE_CHECKING:
    import torch

    HostArray: TypeAlias = np.ndarray | torch.Tensor  # a numpy array or a torch CPU tensor


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

    `greedy`: every sequence takes the argmax, so `run` returns the chosen token ids instead of the
    logits (`StepResult.token_ids`). A tensor-parallel group then sends the head one (max, index)
    pair per rank and row instead of each rank's logit slice (the largest transfer of a decode
    step)."""

    sequences: tuple[StepSequence, ...]
    greedy: bool = False


def split_microbatches(seqs: Sequence[StepSequence], n: int) -> list[tuple[StepSequence, ...]]:
    """`seqs` in order, cut into `min(n, len(seqs))` contiguous groups whose sizes differ by at most
    one (the larger groups first)."""
    n = max(1, min(n, len(seqs)))
    q, r = divmod(len(seqs), n)
    out, i = [], 0
    for k in range(n):
        size = q + (1 if k < r else 0)
        out.append(tuple(seqs[i : i + size]))
        i += size
    return out


class StepResultError(ValueError):
    """A `StepResult` that holds neither or both of logits and token ids, or the wrong shape."""


@dataclass(frozen=True)
class StepResult:
    """What one step yields at each sequence's last new token, row b for `step.sequences[b]`:
    exactly one of `logits` (B, vocab_size) float32 on the host, or `token_ids` (B,) int64 on the
    host, the argmax of each row (ties go to the lowest token id, as `argmax` of the full row)
    when the step was `greedy`. Either is a numpy array or a torch CPU tensor: an executor over
    torch returns tensors, a torch-free one numpy arrays; the head reads both alike."""

    logits: HostArray | None = None
    token_ids: HostArray | None = None

    def __post_init__(self) -> None:
        if (self.logits is None) == (self.token_ids is None):
            raise StepResultError("a StepResult holds exactly one of logits and token_ids")
        if self.logits is not None and np.ndim(self.logits) != 2:
            raise StepResultError(f"logits are (B, vocab), got shape {tuple(self.logits.shape)}")
        if self.token_ids is not None and (
            np.ndim(self.token_ids) != 1 or not _is_integer(self.token_ids)
        ):
            raise StepResultError(
                f"token ids are (B,) integers, got {self.token_ids.dtype} "
                f"{tuple(self.token_ids.shape)}"
            )

    @classmethod
    def of(cls, step: Step, out: HostArray) -> StepResult:
        """`ShardRunner.forward`'s output for `step` on the head, typed: the ids (B,) of a greedy
        step, else the logits (B, vocab)."""
        return cls(token_ids=out) if step.greedy else cls(logits=out)

    def __len__(self) -> int:
        t = self.logits if self.logits is not None else self.token_ids
        assert t is not None
        return t.shape[0]

    def ids(self) -> HostArray:
        """The argmax token id of each row, (B,) integers, whichever form the result holds (a
        numpy array or a torch tensor, as the result holds them)."""
        if self.token_ids is not None:
            return self.token_ids
        assert self.logits is not None
        return self.logits.argmax(-1)

    def pick(self, row: int, params: SamplingParams, generator: np.random.Generator) -> int:
        """Row `row`'s next token: the chosen id of a greedy step, else sampled from its logits."""
        if self.token_ids is not None:
            return int(self.token_ids[row])
        assert self.logits is not None
        return sample_next(self.logits[row], params, generator)


def _is_integer(x: HostArray) -> bool:
    """Integer ids: a numpy array of a signed or unsigned integer dtype, or a torch tensor that is
    not floating point (read by duck typing, without importing torch)."""
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "iu"
    return not is_floating(x)


class Executor(Protocol):
    vocab_size: int
    max_seq_len: int
    max_batch: int

    def run(self, step: Step) -> StepResult:
        """The step's result at each sequence's last new token (see `StepResult`)."""
        ...

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """Makes `dst_seq`, a new sequence, hold `src_seq`'s first `n` cached positions (keys and
        values of every layer, on every rank and stage, each its own shard), as if those tokens
        had been prefilled into it; its next step starts at position n. `src_seq` is untouched.
        A hybrid model's recurrent state holds no earlier position: only a whole copy
        (n = what `src_seq` holds) is taken. A copy the rule refuses raises
        `engine.sequences.PrefixCopyError` before anything changes (`SequenceCache`)."""
        ...

    def release(self, seq_ids: list[int]) -> None:
        """Frees the KV cache of finished sequences (on every rank and stage)."""
        ...

    def health(self) -> tuple[bool, str]:
        """(whole, why): False once a rank or stage has failed or exited, with a line that says
        which. Cheap and safe to call from any thread."""
        ...

    def stats(self) -> dict[str, float]:
        """Cumulative counters for /metrics, each present only when this executor keeps it:
        "collectives", "collective_seconds" (time in collectives), "wire_bytes" (bytes on the
        wire, both ways). Cheap and safe to call from any thread."""
        ...

    def describe(self) -> dict[str, Any]:
        """Who runs what, as a plain JSON-ready dict (`tandem.engine.cluster_info`): the layout,
        the state (forming, whole, re-forming, failed), each rank's host, device, dtype, weight
        format, shard, work share and memory, the links, and the head's cumulative wait and wire
        counters. Cheap (no collective, nothing on the wire) and safe to call from any thread."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Pipelined(Protocol):
    """An executor that keeps up to `num_stages` steps in flight: `submit` starts a step without
    waiting and returns its tag, `collect` returns the oldest submitted step's tag and result
    (results come back in submission order). A caller that keeps one group of sequences in
    flight per stage keeps every stage busy."""

    num_stages: int

    def submit(self, step: Step) -> int: ...

    def collect(self) -> tuple[int, StepResult]: ...
