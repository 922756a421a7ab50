"""Device discovery and the per-device automatic compute dtype.

`--dtype auto` looks the device up in `AUTO_DTYPE_TABLE`, first matching row wins. The rule of the
table: take the 16-bit format the hardware computes natively (decode is bound by reading weights, so
16 bits is about twice as fast as 32), and float32 where no 16-bit arithmetic is native.

The module imports torch only inside the functions that return or take torch objects:
`COMPUTE_DTYPES`, `cpu_flags` and `host_has_accelerator` answer without it. `DTYPE_NAMES` (name ->
torch dtype) is built on first access.
"""

from __future__ import annotations

import glob
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# the compute dtypes a rank may run, by the name flags, frames and reports use
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@cache
def dtype_names() -> dict[str, torch.dtype]:
    """`COMPUTE_DTYPES` name -> torch dtype (imports torch)."""
    import torch

    return {name: getattr(torch, name) for name in COMPUTE_DTYPES}


def __getattr__(name: str) -> Any:
    if name == "DTYPE_NAMES":  # built on first access, so importing this module needs no torch
        return dtype_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the name `DTYPE_NAMES` and the flags use)."""
    return str(dtype).removeprefix("torch.")


def compute_dtype(name: str) -> torch.dtype:
    """One of `DTYPE_NAMES` by name; `DeviceError` for any other."""
    if name not in COMPUTE_DTYPES:
        raise DeviceError(f"dtype {name!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    return dtype_names()[name]


class DeviceError(ValueError):
    """A device that is unknown or not available on this machine."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda", "rocm", "mps", "cpu"
    arch: str  # "sm90", "gfx1100", "avx512_bf16", ...


@dataclass(frozen=True)
class AutoDtypeRule:
    kind: str
    matches: Callable[[str], bool]
    dtype: str  # one of COMPUTE_DTYPES
    why: str


AUTO_DTYPE_TABLE: tuple[AutoDtypeRule, ...] = (
    AutoDtypeRule(
        "rocm", lambda a: a.startswith("gfx11"), "float16", "RDNA3: f16 WMMA, no fast bf16"
    ),
    AutoDtypeRule(
        "rocm", lambda a: a.startswith("gfx9"), "bfloat16", "CDNA: native bf16 matrix cores"
    ),
    AutoDtypeRule("rocm", lambda a: True, "float16", "other AMD GPUs: f16"),
    AutoDtypeRule(
        "cuda", lambda a: _sm(a) >= 80, "bfloat16", "Ampere and newer: bf16 tensor cores"
    ),
    AutoDtypeRule("cuda", lambda a: True, "float16", "pre-Ampere: f16 tensor cores only"),
    AutoDtypeRule("mps", lambda a: True, "float16", "Apple GPUs: f16 native"),
    AutoDtypeRule(
        "cpu",
        lambda a: a in ("amx_bf16", "avx512_bf16"),
        "bfloat16",
        "CPU with bf16 dot-product instructions: half the bytes per weight",
    ),
    AutoDtypeRule("cpu", lambda a: True, "float32", "CPU without bf16 instructions"),
)


def _sm(arch: str) -> int:
    return int(arch[2:]) if arch.startswith("sm") and arch[2:].isdigit() else 0


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_available_bytes() -> int | None:
    """RAM this process can still take: /proc/meminfo's MemAvailable, lowered to the room left
    under this process's cgroup v2 `memory.max` where one is set; psutil's figure off Linux;
    None where unknown. No torch, and no psutil on Linux (the torch-free path asks too)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (KeyError, ValueError, IndexError):
        return None
    try:
        cgroup = next(
            line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )  # fmt: skip
        d = Path("/sys/fs/cgroup") / cgroup.strip().lstrip("/")
        limit = (d / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((d / "memory.current").read_text()))
    except (OSError, StopIteration, ValueError):
        pass
    return max(free, 0)


def host_has_accelerator() -> bool:
    """Whether a GPU torch could use may be present, answered without importing torch: on Linux a
    CUDA (/dev/nvidia0, ...) or ROCm (/dev/kfd) device node, on macOS arm64 (MPS), and on any
    other system True (unknown). False means `resolve_device("auto")` would pick the CPU."""
    if sys.platform == "darwin":
        return platform.machine() == "arm64"
    if sys.platform.startswith("linux"):
        return bool(glob.glob("/dev/nvidia[0-9]*")) or Path("/dev/kfd").exists()
    return True


def resolve_device(name: str | None = None) -> torch.device:
    """`None`/"auto" picks CUDA/ROCm, then MPS, then CPU; an explicit name must be available."""
    import torch

    if name in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise DeviceError(f"unknown device {name!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} requested but no CUDA/ROCm device is available")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r} requested but MPS is not available")
    return dev


def describe(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        if torch.version.hip:
            return DeviceInfo("rocm", getattr(props, "gcnArchName", "gfx").split(":")[0])
        return DeviceInfo("cuda", f"sm{props.major}{props.minor}")
    if device.type == "mps":
        return DeviceInfo("mps", "apple")
    flags = cpu_flags()
    arch = next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), "generic")
    return DeviceInfo("cpu", arch)


def auto_dtype(device: torch.device) -> torch.dtype:
    return dtype_for(describe(device))


def dtype_for(info: DeviceInfo) -> torch.dtype:
    """The first AUTO_DTYPE_TABLE row matching `info`."""
    return dtype_names()[dtype_name_for(info)]


def dtype_name_for(info: DeviceInfo) -> str:
    """The name of the first AUTO_DTYPE_TABLE row's dtype matching `info` (no torch)."""
    for rule in AUTO_DTYPE_TABLE:
        if rule.kind == info.kind and rule.matches(info.arch):
            return rule.dtype
    return "float32"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" or one of DTYPE_NAMES."""
    if name == "auto":
        return auto_dtype(device)
    if name not in COMPUTE_DTYPES:
        raise DeviceError(
            f"unknown dtype {name!r}; choose auto or one of {', '.join(COMPUTE_DTYPES)}"
        )
    return dtype_names()[name]
