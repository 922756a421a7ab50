"""The native kernels' shared library (`csrc/`): compiled on first use with the host's C compiler,
cached, loaded through ctypes with every function's signature declared. Torch-free, so that both
the torch wrappers (`native.py`, `quant.py`, the decode modules) and the torch-free single-node path
(`tandem.kernels.lean`) load one and the same library.

The build: `$CC` (else `cc`, else `gcc`) with `-O3 -march=native -fopenmp -ffp-contract=off
-shared` (no fused multiply-add where the reference form rounds twice), into
`$TANDEM_CACHE/native/<key>/` (default `~/.cache/tandem`), where the key hashes the source, the
compiler's version and this CPU's flags, so a different CPU or compiler gets its own build. The
library is written to a private temporary file and renamed into place, so ranks that start
together on one host never load a half-written file. Loaded after torch, the OpenMP runtime it
links (`libgomp.so.1`) is the one torch already loaded and the kernels run on torch's worker
threads; loaded without torch, it brings its own.

`available()` is False, with `why()` saying why, on anything but Linux on x86-64 with AVX2 + FMA,
without a compiler, when the build fails, or with `TANDEM_NATIVE=0`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from tandem.devices import cpu_flags
from tandem.models.quant.blocks import BY_NAME, UnsupportedTypeError, layout

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / c
    for c in (
        "gemv.c", "decode_ops.c", "decode_block.c", "decode_model.c", "qgemv.c", "qgemm.c",
        "qgemm256.c", "gemm_dense512.c", "moe.c", "sigbus.c",
    )
)  # fmt: skip
HEADERS = tuple(
    CSRC / h
    for h in ("dtypes.h", "quant.h", "canon.h", "qx.h", "qdot256.h", "qdot512.h", "qgemm_drive.h")
)
# TANDEM_NATIVE_MARCH overrides -march=native (e.g. "haswell": the AVX2 paths on an AVX-512 CPU)
MARCH = os.environ.get("TANDEM_NATIVE_MARCH", "native")
FLAGS = ("-O3", f"-march={MARCH}", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
MAX_ROWS = 4  # X rows per call (the C kernel's MAX_ROWS): decode batches up to 4 sequences
BUILD_TIMEOUT_S = 120
# the GGUF types csrc/qgemv.c multiplies
KERNEL_NAMES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "MXFP4",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
KERNEL_TYPES = frozenset(BY_NAME[n].type_id for n in KERNEL_NAMES)  # what csrc/qgemv.c multiplies
DENSE_TYPES = frozenset(BY_NAME[n].type_id for n in ("F32", "F16", "BF16"))
MAX_PARTS = 16  # csrc/qgemv.c: weights per call


def kernel_row_bytes(type_id: int, in_features: int) -> tuple[str, int]:
    """(type name, bytes per row) of a weight of ggml type `type_id`, `in_features` columns wide,
    as csrc/qgemv.c multiplies it; `NativeError` for a type it lacks or a width that is not whole
    blocks (of 32 too, the activations' quantization group). Each caller checks its own array
    (torch or numpy) against the row bytes."""
    try:
        t = layout(type_id)
    except UnsupportedTypeError as e:
        raise NativeError(str(e)) from None
    if t.type_id not in KERNEL_TYPES:
        raise NativeError(f"the native quantized GEMV has no kernel for {t.name}")
    if in_features < 1 or in_features % t.block_size or (t.block_size > 1 and in_features % 32):
        raise NativeError(f"{t.name}: {in_features} columns is not whole blocks")
    return t.name, t.row_bytes(in_features)


class NativeError(ValueError):
    """Arguments a native kernel cannot run (shape, dtype, device or layout)."""


_why = ["not built yet"]


def why() -> str:
    """Why the native kernel is unavailable ("" when it is available)."""
    available()
    return _why[0]


def cache_dir() -> Path:
    base = os.environ.get("TANDEM_CACHE") or os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base else Path.home() / ".cache"
    return (root if os.environ.get("TANDEM_CACHE") else root / "tandem") / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    """The library for this source, compiler and CPU: from the cache, else compiled into it."""
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    flags = " ".join(sorted(cpu_flags()))
    digest = hashlib.sha256(version.encode() + flags.encode() + " ".join(FLAGS).encode())
    for f in (*SOURCES, *HEADERS):
        digest.update(f.read_bytes())
    key = digest.hexdigest()[:16]
    out = cache_dir() / key / "libtandem_native.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if r.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-400:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder's rename wins, both files identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # C function -> (return type, argument types); see csrc/ for the meaning
    "tandem_gemv_isa": (_INT, ()),
    # x, w, bias32, y, M, N, K, dtype, threads
    "tandem_gemv": (_INT, (_P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT)),
    "tandem_stream_read": (ctypes.c_uint64, (_P, _I64, _INT)),
    # x, parts, nparts, bias32, y, M, K, dtype, threads (csrc/quant.h; tandem/kernels/quant.py)
    "tandem_qgemv": (_INT, (_P, _P, _I64, _P, _P, _I64, _I64, _INT, _INT)),
    # choice: 1 the AVX2 prefill kernel for all-K-quant calls, 0 the AVX-512 one, else read only
    "tandem_kquant_prefill": (_INT, (_INT,)),
    # x, x_stride, w, y, rows, dim, eps, dtype, threads
    "tandem_rmsnorm": (_INT, (_P, _I64, _P, _P, _I64, _I64, _F32, _INT, _INT)),
    # x, rows, heads, hd, row_stride, w, eps, cos, sin, pairs, dtype, threads
    "tandem_norm_rope": (_INT, (_P, _I64, _I64, _I64, _I64, _P, _F32, _P, _P, _INT, _INT, _INT)),
    "tandem_silu_mul": (_INT, (_P, _P, _I64, _I64, _INT, _INT)),  # gu, y, rows, inter, dt, thr
    "tandem_argmax": (_INT, (_P, _I64, _I64, _P, _INT)),  # x, rows, n, out, dtype
    # q, q_stride, k, k_strides, v, v_strides, out, B, G, R, S, hd, scale, dtype, threads
    "tandem_decode_attention": (
        _INT,
        (_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT, _INT),
    ),
    # q, q_stride, k, k_strides, v, v_strides, out, T, G, R, start, hd, scale, dtype, threads
    "tandem_prefill_attention": (
        _INT,
        (_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT, _INT),
    ),
    # q, q_strides (b, t), k, k_strides (b, g, s), v, v_strides, out, B, T, G, R, starts, lens,
    # window, sinks (float32 per head or NULL), hd, scale, dtype, threads
    "tandem_step_attention": (
        _INT,
        (_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _F32)
        + (_INT, _INT),
    ),
    # h, norm_w, eps, qkv (tq_linear*), q_norm, k_norm, qk_eps, cos, sin, pairs, k_cache,
    # v_cache, kv_strides, pos, o (tq_linear*), out, D, H, G, hd, scale, dtype, threads
    "tandem_attention_block": (
        _INT,
        (_P, _P, _F32, _P, _P, _P, _F32, _P, _P, _INT, _P, _P, _P, _I64)
        + (_P, _P, _I64, _I64, _I64, _I64, _F32, _INT, _INT),
    ),
    # x, M, D, W, ids, w32, k, first, count, gate, up, down, gate/up/down types, y, dtype, threads
    "tandem_moe_experts": (
        _INT,
        (_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P)
        + (_INT, _INT),
    ),
    # the same with act (tq_moe_act*) before y
    "tandem_moe_experts_act": (
        _INT,
        (_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _P)
        + (_INT, _INT),
    ),
    # logits, M, E, k, norm, ids, w32, dtype
    "tandem_moe_route": (_INT, (_P, _I64, _I64, _I64, _INT, _P, _P, _INT)),
    # h, M, norm_w, eps, router (tq_linear*), E, k, norm, D, W, first, count, gate, up, down,
    # gate/up/down types, out, dtype, threads
    "tandem_moe_block": (
        _INT,
        (_P, _I64, _P, _F32, _P, _I64, _I64, _INT, _I64, _I64, _I64, _I64, _P, _P, _P)
        + (_I64, _I64, _I64, _P, _INT, _INT),
    ),
    # h, norm_w, eps, gate_up (tq_linear*), down (tq_linear*), out, D, I, dtype, threads
    "tandem_mlp_block": (_INT, (_P, _P, _F32, _P, _P, _P, _I64, _I64, _INT, _INT)),
    # layers (tq_layer*), n, h, cos, sin, slot, slot_stride, kv_strides, pos, D, H, G, hd, I,
    # scale, dtype, threads
    "tandem_decode_layers": (
        _INT,
        (_P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _INT)
        + (_INT,),
    ),
    # base, length, file name, exit code (csrc/sigbus.c; tandem/kernels/mapped_guard.py)
    "tandem_watch_mapping": (_INT, (_P, _I64, ctypes.c_char_p, _INT)),
    "tandem_unwatch_mappings": (None, ()),
}


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TANDEM_NATIVE", "1") == "0":
        _why[0] = "disabled by TANDEM_NATIVE=0"
        return None
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        _why[0] = f"needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
        return None
    cc = _compiler()
    if cc is None:
        _why[0] = "no C compiler (set CC, or install cc/gcc)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        _why[0] = f"build failed: {e}"
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.tandem_gemv_isa() == 0:
        _why[0] = "this CPU lacks AVX2 + FMA"
        return None
    _why[0] = ""
    return lib


def library() -> ctypes.CDLL:
    """The loaded kernels, for callers that chain several calls (decode_layer.py)."""
    lib = _library()
    if lib is None:
        raise NativeError(f"the native kernels are unavailable: {_why[0]}")
    return lib


def available() -> bool:
    """The kernel is built and loaded for this CPU (builds it on the first call)."""
    return _library() is not None


def isa() -> int:
    """The vector width the build runs: 256, or 0 when unavailable."""
    lib = _library()
    return 0 if lib is None else lib.tandem_gemv_isa()
