"""The TP split that balances the ranks' compute as measured in service.

The probe at join (`tp.probe`) times a GEMV; a decode token also holds work no probe before loading
sees (the head's sampling and scheduling, attention over the cache, per-layer Python). So every
rank keeps a `ComputeClock`: around each step's forward, the wall time less the time spent inside
collectives (its communicator metered, `comm.metered`), i.e. its own compute with its waits for
peers left out, and the steps counted. Between steps the head asks (a STATS control frame) and every
rank's clock is all-gathered as float32 rows [compute_s, steps].

With share_r rank r's fraction of each token's work under the current plan (`work_share`) and
c_r its compute over the same steps, its time per unit of share is c_r / share_r; shares in
proportion to share_r / c_r give every rank the same compute time where time is linear in share
(one step of the fixed-point iteration towards the balance; fixed per-token costs such as the
head's make it approach, not land on, the balance in one step). As weights, normalized to the
slowest rank = 1:

    w_r = (share_r / c_r) / min_q (share_q / c_q)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from tandem.comm.base import Communicator
from tandem.comm.metered import MeteredCommunicator


class ComputeClock:
    """One rank's compute seconds and steps; unknown (compute -1) where the communicator is not
    metered (its waits could not be told apart)."""

    def __init__(self, comm: Communicator) -> None:
        self._stats = comm.stats if isinstance(comm, MeteredCommunicator) else None
        self.compute_s = 0.0
        self.steps = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self._stats is None:
            self.steps += 1
            yield
            return
        t0, waited = time.perf_counter(), self._stats.seconds
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - t0 - (self._stats.seconds - waited)
            self.steps += 1

    def row(self) -> torch.Tensor:
        compute = self.compute_s if self._stats is not None else -1.0
        return torch.tensor([[compute, float(self.steps)]], dtype=torch.float32)  # (1, 2)


def gather_clocks(comm: Communicator, clock: ComputeClock) -> list[tuple[float, int]]:
    """Collective: every rank's (compute seconds, steps), on every rank."""
    rows = comm.all_gather(clock.row(), 0).tolist()  # (N, 2)
    return [(c, int(n)) for c, n in rows]


def balancing_weights(shares: list[float], compute_s: list[float]) -> tuple[float, ...] | None:
    """The weights that balance the measured compute (module docstring); None where a rank's
    compute is unknown or nil."""
    if not shares or any(c <= 0 for c in compute_s) or any(s <= 0 for s in shares):
        return None
    speed = [s / c for s, c in zip(shares, compute_s, strict=True)]
    slowest = min(speed)
    return tuple(round(v / slowest, 3) for v in speed)


def balance_entry(
    shares: list[float], weights: tuple[float, ...], clocks: list[tuple[float, int]]
) -> dict | None:
    """What the head shows: the steps measured, each rank's compute ms per step, the weights now
    and the balancing weights; None before any step or where a clock is unknown."""
    steps = clocks[0][1]
    compute = [c for c, _ in clocks]
    balanced = balancing_weights(shares, compute)
    if steps == 0 or balanced is None:
        return None
    return {
        "steps": steps,
        "compute_ms_per_step": [round(1e3 * c / steps, 3) for c in compute],
        "weights": [round(w, 3) for w in weights],
        "balanced_weights": list(balanced),
    }
