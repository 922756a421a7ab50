"""Refining an `auto` TP split at join with a short real decode.

The probe (`tp.probe`) times a GEMV with every rank busy all the time; a decode also holds work it
does not see (the head's LM head gather and sampling, attention, per-layer Python), and a rank under
a CPU quota runs faster with a smaller share (it idles longer between bursts and runs more of each
before the quota cuts in), so the probe's split overshoots such a rank. So once every shard is
loaded and admitted, a group whose weights came from the probe decodes WARMUP_SKIP + WARMUP_STEPS
one-token steps of a throwaway sequence (the same steps on every rank: no control frames; the
first WARMUP_SKIP not clocked, as they hold one-time set-up), each rank clocking its
compute with its waits left out (`tp.balance.ComputeClock`). The head turns the clocks into the
balancing weights (`tp.balance.balancing_weights`: share / compute, slowest = 1) and broadcasts
them; where they move any rank's weight relative to the slowest by more than REFINE_MIN_CHANGE,
every rank loads its shard again under them (one step of the fixed-point iteration towards the
balance, taken once).

    decision (float32, 1 + world_size, broadcast from the head):  [1, w_0 .. w_{N-1}] to
                                                                  reload, [0, ...] to keep
"""

from __future__ import annotations

import torch

from tandem.comm.base import Communicator
from tandem.engine.executor import Step, StepSequence
from tandem.engine.runner import ShardRunner
from tandem.engine.tp.balance import ComputeClock, balancing_weights, gather_clocks

WARMUP_SKIP = 2  # decode steps run first and not clocked
WARMUP_STEPS = 8
WARMUP_SEQ = 2**31 - 1  # a sequence id no caller uses
REFINE_MIN_CHANGE = 0.15


def warmup_clocks(comm: Communicator, runner: ShardRunner) -> list[tuple[float, int]]:
    """Collective: WARMUP_STEPS one-token decode steps on every rank's shard, clocked; every
    rank's (compute seconds, steps), on every rank. The sequence is released after."""
    clock = ComputeClock(comm)
    steps = min(WARMUP_SKIP + WARMUP_STEPS, runner.max_seq_len)
    for pos in range(steps):
        step = Step((StepSequence(WARMUP_SEQ, (1,), pos),))
        if pos < WARMUP_SKIP:  # first calls: kernels' one-time set-up, pages first touched
            runner.forward(step)
            continue
        with clock.step():
            runner.forward(step)
    runner.release([WARMUP_SEQ])
    return gather_clocks(comm, clock)


def refined_weights(
    shares: list[float], weights: tuple[float, ...], clocks: list[tuple[float, int]]
) -> tuple[float, ...] | None:
    """The balancing weights where they move a rank's weight (relative to the slowest) by more
    than REFINE_MIN_CHANGE from `weights`; None to keep them (or where a clock is unknown)."""
    balanced = balancing_weights(shares, [c for c, _ in clocks])
    if balanced is None:
        return None
    low = min(weights)
    now = [w / low for w in weights]
    if max(abs(b / w - 1) for b, w in zip(balanced, now, strict=True)) <= REFINE_MIN_CHANGE:
        return None
    return balanced


def agree_refinement(
    comm: Communicator, proposal: tuple[float, ...] | None
) -> tuple[float, ...] | None:
    """The head's `proposal` (the others pass None) broadcast: the weights to reload with, or
    None to keep the shards."""
    n = comm.world_size
    t = torch.zeros(1 + n, dtype=torch.float32)
    if comm.rank == 0 and proposal is not None:
        t = torch.tensor([1.0, *proposal], dtype=torch.float32)
    t = comm.broadcast(t, 0)
    return tuple(t[1:].tolist()) if float(t[0]) == 1.0 else None
