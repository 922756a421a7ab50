"""What one process measures about its own device for placement, with no group: its decode GEMV
speed (weight bytes per second through its own linear kernel, `kernels.linear`, in its compute
dtype and on its own torch threads) and its free memory. A TP rank runs the GEMV in lockstep with
its group (`tandem.engine.tp.probe`); a pipeline stage runs `measure_local` before it loads a layer
(`--pp-weights auto`, `tandem.engine.pp.layout.auto_ranges`).

The GEMV speed is total bytes over total time of one window of `probe_window_s()` seconds, not a
median of short windows. A process under a CFS quota of q CPUs over a period P runs at full speed
for q P and then waits out the period: a window shorter than P sees either the full-speed stretch
or the throttled one, never the average a decode token (hundreds of ms of work) feels. So the window
spans QUOTA_PERIODS periods of the tightest quota over the process's cgroup and its ancestors
(cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), at least MIN_WINDOW_S; where no
quota is set, PLAIN_WINDOW_S (several CFS scheduling latencies: what a shared core slices at); where
no cgroup can be read, MIN_WINDOW_S.
"""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import psutil
import torch

from tandem.kernels.linear import linear

PROBE_BYTES = 16 << 20
PROBE_COLS = 2048
FILL_ROWS = 64  # rows of the probe weight drawn at a time (a 512 KiB float32 temporary)
QUOTA_PERIODS = 4
MIN_WINDOW_S = 0.3
PLAIN_WINDOW_S = 0.15
CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def free_gb(device: torch.device) -> float:
    """Memory the device has free: host available RAM, or CUDA `mem_get_info`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 1e9
    return psutil.virtual_memory().available / 1e9


def _v1_quota(d: Path) -> tuple[float, float] | None:
    quota = int((d / "cpu.cfs_quota_us").read_text())
    period = int((d / "cpu.cfs_period_us").read_text())
    return (quota / period, period / 1e6) if quota > 0 and period > 0 else None


def _v2_quota(d: Path) -> tuple[float, float] | None:
    quota, period = (d / "cpu.max").read_text().split()
    return None if quota == "max" else (int(quota) / int(period), int(period) / 1e6)


def cpu_quota(
    proc_cgroup: str | None = None, root: Path = CGROUP_ROOT
) -> tuple[float, float] | None:
    """(CPUs, period in s) of the tightest CFS quota over this process's cgroup and its ancestors
    (`proc_cgroup`: the text of /proc/self/cgroup); None where no quota is set. Raises OSError
    where no cgroup's CPU controller could be read at all."""
    if proc_cgroup is None:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    found: list[tuple[float, float]] = []
    read_any = False
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            bases, read = [root, root / "unified"], _v2_quota
        elif "cpu" in controllers.split(","):
            bases, read = [root / name for name in _V1_CPU_DIRS], _v1_quota
        else:
            continue
        rel = Path(path.lstrip("/"))
        for base in bases:
            for d in [base / rel, *[base / p for p in rel.parents]]:
                try:
                    q = read(d)
                except (OSError, ValueError):
                    continue
                read_any = True
                if q is not None:
                    found.append(q)
    if not read_any:
        raise FileNotFoundError("no cgroup CPU controller readable for this process")
    return min(found) if found else None


def probe_window_s() -> float:
    """How long the GEMV probe runs (module docstring)."""
    try:
        quota = cpu_quota()
    except (OSError, ValueError):
        return MIN_WINDOW_S
    if quota is None:
        return PLAIN_WINDOW_S
    return max(MIN_WINDOW_S, QUOTA_PERIODS * quota[1])


def probe_operands(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's weight (PROBE_BYTES in `dtype`) and one-row input, seeded, on `device`,
    after one warm-up call."""
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = max(1, PROBE_BYTES // (PROBE_COLS * elem))
    g = torch.Generator().manual_seed(1)
    w = _mapped_normal(rows, PROBE_COLS, dtype, g).to(device)  # (rows, cols)
    x = torch.randn((1, PROBE_COLS), generator=g).to(device, dtype)  # (1, cols)
    linear(x, w)
    return w, x


def _mapped_normal(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """(rows, cols) N(0, 1) draws in `dtype` on the host, in an anonymous mapping of their own,
    unmapped when the tensor goes. Not from the allocator's heap: a block of this size that glibc
    once handed back raises its mmap threshold (up to 32 MiB), so the next probe's weight would
    come from a heap whose top the allocator keeps (a thread's arena: `malloc_trim` does not
    return it), and each group formed again would leave the process that much larger. Drawn
    FILL_ROWS rows at a time, so no temporary of the whole size is made either."""
    elem = torch.tensor([], dtype=dtype).element_size()
    buf = mmap.mmap(-1, rows * cols * elem)
    w = torch.frombuffer(buf, dtype=dtype).view(rows, cols)  # holds `buf` while it lives
    for r in range(0, rows, FILL_ROWS):
        n = min(FILL_ROWS, rows - r)
        w[r : r + n].copy_(torch.randn((n, cols), generator=g))
    return w


def timed_gemv(w: torch.Tensor, x: torch.Tensor) -> float:
    """Seconds of one decode GEMV `x w^T` on w's device (synchronized on CUDA)."""
    t0 = time.perf_counter()
    linear(x, w)
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)
    return time.perf_counter() - t0


def gemv_gb_s(device: torch.device, dtype: torch.dtype, window_s: float | None = None) -> float:
    """Weight bytes per second of the process's decode GEMV: GEMVs back to back for `window_s`
    (default `probe_window_s()`), total bytes over total time."""
    window = probe_window_s() if window_s is None else window_s
    w, x = probe_operands(device, dtype)
    calls, busy = 0, 0.0
    while busy < window:
        busy += timed_gemv(w, x)
        calls += 1
    return calls * w.numel() * w.element_size() / busy / 1e9


def measure_local(
    device: str, dtype: str, mem_limit_gb: float | None = None
) -> tuple[float, float]:
    """This process alone: (GEMV GB/s, free GB) on its device and dtype, no group (a pipeline
    stage measures itself this way before it loads a layer). `mem_limit_gb` caps the free figure."""
    dev = torch.device(device)
    gemv = gemv_gb_s(dev, getattr(torch, dtype))
    free = free_gb(dev) if mem_limit_gb is None else min(free_gb(dev), mem_limit_gb)
    return gemv, free
