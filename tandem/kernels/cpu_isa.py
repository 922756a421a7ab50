"""The ISA variants the native kernels are built in, and which of them this host may run.

A variant is one build of every source in `csrc/` with its own `-march` flags:

| variant     | flags                                            | needs (CPUID and the OS's XCR0)          |
|-------------|--------------------------------------------------|------------------------------------------|
| `avx2`      | `-march=haswell`                                 | AVX2 + FMA + F16C, YMM state             |
| `avx2-vnni` | `-march=haswell -mavxvnni`                       | the above + AVX-VNNI                     |
| `avx512`    | `-march=haswell` + AVX-512 F/BW/VL/DQ/CD/VNNI    | the above + AVX-512 VNNI, ZMM state      |
|             | (+ BF16, VBMI where this CPU has them)           |                                          |

An instruction set counts only when the CPU advertises it *and* the OS saves its registers
(XCR0, read with XGETBV): a VM can advertise AVX-512 with its state off, and then a build that
uses it dies with SIGILL. `csrc/cpu_probe.c` reads both, compiled for plain x86-64 so it runs
before any vector build is touched. AMX is reported (CPUID, XCR0 tile state and Linux's
`ARCH_REQ_XCOMP_PERM` permission) but no variant uses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

PROBE_SOURCE = Path(__file__).with_name("csrc") / "cpu_probe.c"

# csrc/cpu_probe.c's feature bits
AVX2, AVXVNNI, AVX512, AVX512BF16, AVX512VBMI, AMX = (1 << i for i in range(6))
FEATURE_NAMES = {
    AVX2: "avx2",
    AVXVNNI: "avx-vnni",
    AVX512: "avx512-vnni",
    AVX512BF16: "avx512-bf16",
    AVX512VBMI: "avx512-vbmi",
    AMX: "amx",
}


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: `name`, the features it needs, its compiler flags."""

    name: str
    needs: int
    march: tuple[str, ...]

    def flags(self, features: int) -> tuple[str, ...]:
        """Its `-march` flags on a host with `features` (AVX-512 BF16 / VBMI where present)."""
        extra: tuple[str, ...] = ()
        if self.needs & AVX512:
            extra += ("-mavx512bf16",) if features & AVX512BF16 else ()
            extra += ("-mavx512vbmi",) if features & AVX512VBMI else ()
        return self.march + extra


AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")
VARIANTS = (  # narrowest first: avx2 is the primary build (library.py)
    Variant("avx2", AVX2, ("-march=haswell",)),
    Variant("avx2-vnni", AVX2 | AVXVNNI, ("-march=haswell", "-mavxvnni")),
    Variant("avx512", AVX2 | AVX512, ("-march=haswell", *AVX512_FLAGS, "-mavx512vnni")),
)
BY_NAME = {v.name: v for v in VARIANTS}


class ProbeError(OSError):
    """The CPU probe could not be built or run."""


def _probe_library(cc: str, cache: Path) -> Path:
    """csrc/cpu_probe.c as a shared library, from the cache or compiled into it."""
    digest = hashlib.sha256(PROBE_SOURCE.read_bytes() + cc.encode()).hexdigest()[:16]
    out = cache / f"probe-{digest}" / "libtandem_cpu_probe.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        cmd = [cc, "-O1", "-fPIC", "-shared", "-o", tmp, str(PROBE_SOURCE)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise ProbeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def host_features(cc: str, cache: Path) -> int:
    """csrc/cpu_probe.c's feature bits for this CPU and OS."""
    try:
        return int(ctypes.CDLL(str(_probe_library(cc, cache))).tandem_cpu_features())
    except (OSError, subprocess.SubprocessError) as e:
        raise ProbeError(f"the CPU probe failed: {e}") from None


def runnable(features: int) -> tuple[Variant, ...]:
    """The variants a host with `features` runs, narrowest first."""
    return tuple(v for v in VARIANTS if features & v.needs == v.needs)


def feature_names(features: int) -> list[str]:
    return [n for bit, n in FEATURE_NAMES.items() if features & bit]


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), "unknown" where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
