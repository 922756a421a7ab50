"""What placement needs to know about each rank, measured on the rank itself as a group forms.

Every rank, at the same moment (the group is in lockstep), measures on its own device and dtype:

    gemv_gb_s       a one-row decode GEMV through the rank's own linear kernel (`kernels.linear`),
                    over a PROBE_BYTES weight matrix in its compute dtype and on its own threads
                    (`tandem.engine.device_probe`), run in lockstep as a decode runs: every rank
                    does one GEMV, then the group all-reduces, step after step for the probe window
                    (`device_probe.probe_window_s`, several CFS quota periods). A rank's figure is
                    the bytes it streamed over the time it spent in its GEMVs only, its waits in
                    the all-reduce excluded: the compute a decode at the equal split times. So the
                    fast rank idles while the slow one finishes, as in service (a rank alone on
                    the memory bus streams faster than two at once), and a rank whose core is
                    shared with a peer spinning in the all-reduce is slowed as in service
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
from tandem.engine.device_probe import free_gb, probe_operands, probe_window_s, timed_gemv

PING_REPEATS = 9
MIN_STEPS = 8  # lockstep GEMV steps at the least, however long the window
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


def lockstep_gemv_gb_s(
    comm: Communicator, device: torch.device, dtype: torch.dtype, window_s: float
) -> float:
    """Collective: this rank's GEMV GB/s in lockstep with the group (module docstring). Every rank
    runs the same number of steps: each step's all-reduce carries every rank's elapsed time, and
    all stop at the first step where the longest has reached `window_s` (the sum is bit-identical
    on every rank, so every rank decides the same)."""
    w, x = probe_operands(device, dtype)
    n, steps, busy = comm.world_size, 0, 0.0
    t0 = time.perf_counter()
    while True:
        busy += timed_gemv(w, x)
        steps += 1
        clock = torch.zeros(n, dtype=torch.float32)  # (N,): slot r is rank r's elapsed seconds
        clock[comm.rank] = time.perf_counter() - t0
        if float(comm.all_reduce_sum(clock).max()) >= window_s and steps >= MIN_STEPS:
            break
    return steps * w.numel() * w.element_size() / busy / 1e9


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
    mine_window = torch.tensor([probe_window_s()], dtype=torch.float32)
    window = float(comm.all_gather(mine_window, 0).max())  # the longest any rank asks for
    comm.barrier()  # measure together: co-located ranks share what they share in service too
    gemv = lockstep_gemv_gb_s(comm, dev, getattr(torch, dtype), window)
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


@dataclass(frozen=True)
class RankKind:
    """What a rank is, as opposed to what it measured: facts that do not vary from run to run."""

    device: str  # device kind: "cpu", "cuda", ...
    dtype: str
    host: str
    threads: int
    cpu_quota: float  # CPUs its cgroup's CFS quota allows; 0: none


@dataclass(frozen=True)
class WeightsChoice:
    """The TP weights a group forms with, how they were chosen ("given", "auto" or "equal") and
    why, in words for a person."""

    weights: tuple[float, ...]
    how: str
    why: str

    def line(self) -> str:
        ws = " : ".join(f"{w:g}" for w in self.weights)
        return f"TP weights {ws} ({self.how}: {self.why})"


def choose_weights(
    requested: tuple[float, ...] | str | None,
    probes: list[RankProbe],
    kinds: list[RankKind],
) -> WeightsChoice:
    """`--tp-weights` as given; "auto": `auto_weights`; not given: `auto_weights` when the ranks
    differ in a fact (device kind, dtype, host, CPU threads, CFS quota), else the equal split.
    Among alike ranks (one host, the same dtype, threads and quota) a spread of the probe is the
    contention of the moment, not a property of the ranks: two alike ranks of three TP groups
    forming at once on 2 cores probed 1.75x apart. So it does not move the default."""
    n = len(probes)
    speeds = [max(p.gemv_gb_s, 1e-9) for p in probes]
    if requested == "auto":
        return WeightsChoice(auto_weights(probes), "auto", f"--tp-weights auto, {_speeds(speeds)}")
    if requested is not None:
        return WeightsChoice(tuple(float(w) for w in requested), "given", "--tp-weights")
    differ = [
        f"{name} {'/'.join(str(getattr(k, name)) for k in kinds)}"
        for name in ("device", "dtype", "host", "threads", "cpu_quota")
        if len({getattr(k, name) for k in kinds}) > 1
    ]
    if differ:
        why = f"the ranks differ in {', '.join(differ)}; {_speeds(speeds)}"
        return WeightsChoice(auto_weights(probes), "auto", why)
    why = f"alike ranks (one host, the same device, dtype, threads and quota); {_speeds(speeds)}"
    return WeightsChoice((1.0,) * n, "equal", why)


def _speeds(speeds: list[float]) -> str:
    return "probed GEMV GB/s " + ", ".join(f"{s:.2f}" for s in speeds)
