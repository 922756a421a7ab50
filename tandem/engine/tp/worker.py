"""A worker: a stateless executor holding one shard of the model and its KV cache.

It has no generation loop of its own. It waits for the head's control frames and, for each step,
runs its shard of the forward (joining the layers' collectives); it never samples, and it leaves when
the head says stop or when the head's connection closes (the communicator raises, the process
exits), so a worker cannot outlive its head.

`WorkerRole` says where this process sits: its rank in its tensor-parallel group, its pipeline
stage and that stage's half-open layer range. Pure TP is the one-stage case (stage 0 holds every
layer, the embedding and the head); pipeline parallelism gives each stage its own range and TP group,
and supplies control frames and hidden states through a different `StepSource`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.comm.base import Communicator
from tandem.engine.runner import ShardRunner
from tandem.engine.tp import control
from tandem.engine.tp.balance import ComputeClock, gather_clocks
from tandem.engine.tp.control import Control, recv_control

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerRole:
    """Where a worker sits in a (PP stages) x (TP ranks) grid; layer ranges are half-open."""

    tp_rank: int
    tp_size: int
    stage: int = 0
    n_stages: int = 1
    layer_range: tuple[int, int] | None = None  # None: every layer

    @property
    def with_embed(self) -> bool:
        return self.stage == 0

    @property
    def with_head(self) -> bool:
        return self.stage == self.n_stages - 1


class StepSource(Protocol):
    """Where a worker gets its next control message (and, for a later pipeline stage, the previous
    stage's hidden state)."""

    def next(self) -> tuple[Control, torch.Tensor | None]: ...


class BroadcastSource:
    """Control frames broadcast by rank `src` of the TP group (the head, in pure TP)."""

    def __init__(self, comm: Communicator, src: int = 0) -> None:
        self.comm, self.src = comm, src

    def next(self) -> tuple[Control, torch.Tensor | None]:
        return recv_control(self.comm, self.src), None


def serve(runner: ShardRunner, source: StepSource, clock: ComputeClock | None = None) -> int:
    """Runs control messages until STOP; returns how many steps ran. Any error propagates (the
    caller exits, which closes its sockets, which the head sees at once). `clock`: times each
    step's compute, gathered on the head's STATS (`tp.balance`; a TP group's source only)."""
    steps = 0
    clock = clock or ComputeClock(getattr(source, "comm", None))
    while True:
        msg, h_in = source.next()
        if msg.release:
            runner.release(msg.release)
        if msg.kind == control.KIND_STOP:
            log.info("worker: stop after %d steps", steps)
            return steps
        if msg.kind == control.KIND_COPY:
            assert msg.copy is not None
            runner.copy_prefix(*msg.copy)
        if msg.kind == control.KIND_STATS:
            gather_clocks(source.comm, clock)  # type: ignore[attr-defined]
        if msg.kind == control.KIND_STEP:
            assert msg.step is not None
            with clock.step():
                runner.forward(msg.step, h_in)
            steps += 1
