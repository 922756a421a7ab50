"""What placement needs to know about each rank, measured on the rank itself as a group forms.

Every rank, at the same moment (the group is in lockstep), measures on its own device and dtype:

    gemv_gb_s       (`tandem.engine.device_probe`, shared with pipeline stages) a one-row decode GEMV through the rank's own linear kernel (`kernels.linear`),
                    over a PROBE_BYTES weight matrix in its compute dtype: weight bytes streamed per
                    second, the quantity a decode token's time is made of. Timed as GEMVs back to
                    back over a GEMV_WINDOW_S window (median of GEMV_REPEATS windows), not one call:
                    a rank under a CPU quota (a CFS period of a few ms) runs one call at full speed
                    and pays for it in the next period, so only a window spanning periods sees it
    free_gb         memory its device has free (host: available RAM; CUDA: `mem_get_info`)
    allreduce_ms    the median of one-float all-reduces over the group: the group's round trip
                    (over same-host shared memory where the ranks share a host)
    goodput_mbit_s  a GOODPUT_BYTES all-reduce: payload bits each rank moved per second (a ring
                    moves 2 (N-1)/N of the tensor per rank)

The rows are all-gathered (float32 on the wire), so every rank holds every rank's probe; the head
shows them (`describe`, the web page, `/v1/cluster`) and `auto_weights` turns them into TP weights.
The link figures are the group's, measured by a collective, not one link's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tandem.comm.base import Communicator
from tandem.engine.device_probe import free_gb, gemv_gb_s

PING_REPEATS = 9
GOODPUT_BYTES = 4 << 20
FIELDS = ("gemv_gb_s", "free_gb", "allreduce_ms", "goodput_mbit_s")


@dataclass(frozen=True)
class RankProbe:
    rank: int
    gemv_gb_s: float
    free_gb: float
    allreduce_ms: float
    goodput_mbit_s: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items() if k != "rank"}


def _allreduce_ms(comm: Communicator) -> float:
    one = torch.zeros(1, dtype=torch.float32)
    times = []
    for _ in range(PING_REPEATS):
        t0 = time.perf_counter()
        comm.all_reduce_sum(one)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _goodput_mbit_s(comm: Communicator) -> float:
    n = comm.world_size
    big = torch.zeros(GOODPUT_BYTES // 4, dtype=torch.float32)
    comm.all_reduce_sum(big)  # warm-up: buffers, pages
    t0 = time.perf_counter()
    comm.all_reduce_sum(big)
    dt = time.perf_counter() - t0
    return 2 * (n - 1) / n * GOODPUT_BYTES * 8 / dt / 1e6


def measure(
    comm: Communicator,
    device: str,
    dtype: str,
    mem_limit_gb: float | None = None,
    held_gb: float = 0.0,
) -> list[RankProbe]:
    """Collective: every rank measures itself, then all rows are gathered on every rank.
    `mem_limit_gb`: this rank offers at most that much memory (its free figure is capped), for a
    rank that shares its device with other work. `held_gb`: memory this rank already holds for
    the group (a shard it keeps across a re-form), counted as free."""
    dev = torch.device(device)
    comm.barrier()  # measure together: co-located ranks share what they share in service too
    gemv = gemv_gb_s(dev, getattr(torch, dtype))
    ping = _allreduce_ms(comm)
    good = _goodput_mbit_s(comm)
    free = free_gb(dev) + held_gb
    free = free if mem_limit_gb is None else min(free, mem_limit_gb)
    mine = torch.tensor([[gemv, free, ping, good]], dtype=torch.float32)
    rows = comm.all_gather(mine, 0).tolist()  # (N, len(FIELDS))
    return [RankProbe(r, *row) for r, row in enumerate(rows)]


def auto_weights(probes: list[RankProbe]) -> tuple[float, ...]:
    """TP weights that equalize predicted decode time per token: a rank's time is its share of
    the weight bytes over its GEMV bytes per second, so shares proportional to the measured speed
    make every rank's time equal. Normalized to the slowest rank = 1."""
    speeds = [max(p.gemv_gb_s, 1e-6) for p in probes]
    slowest = min(speeds)
    return tuple(round(s / slowest, 3) for s in speeds)
