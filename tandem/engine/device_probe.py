"""What one process measures about its own device for placement, with no group: its decode GEMV
speed (weight bytes per second through its own linear kernel, `kernels.linear`, in its compute
dtype) and its free memory. A TP rank runs these inside the group's collective probe
(`tandem.engine.tp.probe`); a pipeline stage runs `measure_local` before it loads a layer
(`--pp-weights auto`, `tandem.engine.pp.layout.auto_ranges`).

The GEMV is timed as calls back to back over a GEMV_WINDOW_S window (median of GEMV_REPEATS windows),
not one call: a process under a CPU quota (a CFS period of a few ms) runs one call at full speed
and pays for it in the next period, so only a window spanning periods sees it.
"""

from __future__ import annotations

import statistics
import time

import psutil
import torch

from tandem.kernels.linear import linear

PROBE_BYTES = 16 << 20
PROBE_COLS = 2048
GEMV_REPEATS = 3
GEMV_WINDOW_S = 0.04


def free_gb(device: torch.device) -> float:
    """Memory the device has free: host available RAM, or CUDA `mem_get_info`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 1e9
    return psutil.virtual_memory().available / 1e9


def gemv_gb_s(device: torch.device, dtype: torch.dtype) -> float:
    """Weight bytes per second of the rank's decode GEMV: GEMVs back to back for GEMV_WINDOW_S,
    median of GEMV_REPEATS windows after a warm-up."""
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = max(1, PROBE_BYTES // (PROBE_COLS * elem))
    g = torch.Generator().manual_seed(1)
    w = torch.randn((rows, PROBE_COLS), generator=g).to(device, dtype)  # (rows, cols)
    x = torch.randn((1, PROBE_COLS), generator=g).to(device, dtype)  # (1, cols)
    linear(x, w)
    rates = []
    for _ in range(GEMV_REPEATS):
        calls, t0 = 0, time.perf_counter()
        while True:
            linear(x, w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            calls += 1
            dt = time.perf_counter() - t0
            if dt >= GEMV_WINDOW_S:
                break
        rates.append(calls * w.numel() * elem / dt)
    return statistics.median(rates) / 1e9


def measure_local(
    device: str, dtype: str, mem_limit_gb: float | None = None
) -> tuple[float, float]:
    """This process alone: (GEMV GB/s, free GB) on its device and dtype, no group (a pipeline
    stage measures itself this way before it loads a layer). `mem_limit_gb` caps the free figure."""
    dev = torch.device(device)
    gemv = gemv_gb_s(dev, getattr(torch, dtype))
    free = free_gb(dev) if mem_limit_gb is None else min(free_gb(dev), mem_limit_gb)
    return gemv, free
