"""tandem's CPU decode kernels (`csrc/`), built on first use with the host's C compiler and
called through ctypes: no Python headers, no torch headers, a build of about a second.

- `gemv` (csrc/gemv.c): Y = X W^T for the decode-sized X (<= MAX_ROWS rows) of every linear layer;
- `tandem_qgemv` (csrc/qgemv.c, called by quant.py): the same over GGUF block-quantized weights,
  for decode and prefill;
- `rmsnorm`, `norm_rope_`, `silu_mul`, `decode_attention` (csrc/decode_ops.c): the small
  per-layer operations, one call each instead of 4-12 tensor ops, in the reference form's
  rounding; `argmax`, the greedy pick over a row of logits (torch's is single-threaded and
  converts 16-bit rows element by element: 0.6 ms for Qwen3's 151936 bf16 logits, ~0.1 here);
- csrc/decode_block.c chains them into a decoder layer's two halves for one decode token
  (decode_layer.py), so no Python runs between the weight streams; csrc/decode_model.c chains
  those halves over all of a model's held layers in one call (decode_model.py).

Why a kernel of our own: decode at batch 1 reads every weight once per token, so its speed is
the rate at which the GEMVs stream the weights. On the x86 CPUs measured here the libraries in the
pinned torch stream 55-75% of a plain read (`sum`): oneDNN's f32 inner product 20-24 GB/s, its
packed bf16 one 13-25, MKL / OpenBLAS sgemv 12-23, against `sum` at 30-43 GB/s with 2 threads.
`gemv.c` streams each thread's rows front to back and reaches 80-90% of `sum` (scripts/bench/gemv.py).
Once the GEMVs stream that fast, the rest of a decode step (RMSNorms, RoPE, SwiGLU, attention,
each a chain of microsecond dispatches) was 13-14 ms of a 60-70 ms bf16 token on Qwen3-0.6B;
one call per op brought it to ~9 ms measured warm, but with the caches each weight stream had just
evicted the Python in between still cost 10-15 ms; two calls per layer leave ~3 ms.

The build: `$CC` (else `cc`, else `gcc`) with `-O3 -march=native -fopenmp -ffp-contract=off
-shared` (no fused multiply-add where the reference form rounds twice), into
`$TANDEM_CACHE/native/<key>/` (default `~/.cache/tandem`), where the key hashes the source, the
compiler's version and this CPU's flags, so a different CPU or compiler gets its own build. The
library is written to a private temporary file and renamed into place, so ranks that start
together on one host never load a half-written file. It is loaded after torch, so the OpenMP
runtime it links (`libgomp.so.1`) is the one torch already loaded and the kernel runs on torch's
worker threads.

`available()` is False, with `why()` saying why, on anything but Linux on x86-64 with AVX2 + FMA,
without a compiler, when the build fails, or with `TANDEM_NATIVE=0`; the caller then keeps the
library kernels. Nothing here raises for an unavailable kernel; each operation raises
`NativeError` for arguments it cannot run.
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

import torch

from tandem.devices import cpu_flags

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / c
    for c in (
        "gemv.c", "decode_ops.c", "decode_block.c", "decode_model.c", "qgemv.c", "qgemm.c",
        "qgemm256.c",
    )
)  # fmt: skip
HEADERS = tuple(
    CSRC / h for h in ("dtypes.h", "quant.h", "qx.h", "qdot256.h", "qdot512.h", "qgemm_drive.h")
)
# TANDEM_NATIVE_MARCH overrides -march=native (e.g. "haswell": the AVX2 paths on an AVX-512 CPU)
MARCH = os.environ.get("TANDEM_NATIVE_MARCH", "native")
FLAGS = ("-O3", f"-march={MARCH}", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
MAX_ROWS = 4  # X rows per call (the C kernel's MAX_ROWS): decode batches up to 4 sequences
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BUILD_TIMEOUT_S = 120


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
    # x, x_stride, w, y, rows, dim, eps, dtype, threads
    "tandem_rmsnorm": (_INT, (_P, _I64, _P, _P, _I64, _I64, _F32, _INT, _INT)),
    # x, rows, heads, hd, row_stride, w, eps, cos, sin, dtype, threads
    "tandem_norm_rope": (_INT, (_P, _I64, _I64, _I64, _I64, _P, _F32, _P, _P, _INT, _INT)),
    "tandem_silu_mul": (_INT, (_P, _P, _I64, _I64, _INT, _INT)),  # gu, y, rows, inter, dt, thr
    "tandem_argmax": (_INT, (_P, _I64, _I64, _P, _INT)),  # x, rows, n, out, dtype
    # q, q_stride, k, k_strides, v, v_strides, out, B, G, R, S, hd, scale, dtype, threads
    "tandem_decode_attention": (
        _INT,
        (_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT, _INT),
    ),
    # h, norm_w, eps, qkv (tq_linear*), q_norm, k_norm, qk_eps, cos, sin, k_cache, v_cache,
    # kv_strides, pos, o (tq_linear*), out, D, H, G, hd, scale, dtype, threads
    "tandem_attention_block": (
        _INT,
        (_P, _P, _F32, _P, _P, _P, _F32, _P, _P, _P, _P, _P, _I64)
        + (_P, _P, _I64, _I64, _I64, _I64, _F32, _INT, _INT),
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


def supports(weight: torch.Tensor) -> bool:
    """`weight` (out, in) can be multiplied by the native kernel as it is stored."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in DTYPE_CODES
        and weight.dim() == 2
        and weight.is_contiguous()
        and not weight.is_mkldnn
        and available()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias32)` for x (..., in) with at most MAX_ROWS rows -> (..., out), in
    weight's dtype; x is cast to it. `bias32`: float32 (out) or None. Checks every argument;
    `gemv_unchecked` is the same call for a weight and bias checked once (KernelLinear)."""
    if _library() is None:
        raise NativeError(f"the native GEMV is unavailable: {_why[0]}")
    if not supports(weight):
        raise NativeError(
            f"the native GEMV needs a contiguous 2-d CPU weight of {', '.join(map(str, DTYPE_CODES))}"
        )
    n, k = weight.shape
    if x.shape[-1] == k and not 1 <= x.numel() // k <= MAX_ROWS:  # other widths: gemv_unchecked
        raise NativeError(f"the native GEMV takes 1..{MAX_ROWS} rows, got {x.numel() // k}")
    if bias32 is not None and (
        bias32.shape != (n,) or bias32.dtype != torch.float32 or not bias32.is_contiguous()
    ):
        raise NativeError(f"the bias must be contiguous float32 ({n},)")
    return gemv_unchecked(x, weight, bias32)


def gemv_unchecked(
    x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None
) -> torch.Tensor:
    """`gemv` without the weight, bias and row-count checks, for the decode loop: the caller
    guarantees a weight `supports` accepts, x of 1..MAX_ROWS rows, bias32 float32 (out) or None.
    x's width is still checked: a wider x of few enough elements would read as more rows and
    overrun y."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise NativeError(f"x has {x.shape[-1]} features, the weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=weight.dtype)  # (..., in) -> (..., out)
    rc = _library().tandem_gemv(
        x.data_ptr(), weight.data_ptr(), None if bias32 is None else bias32.data_ptr(),
        y.data_ptr(), x.numel() // k, n, k, DTYPE_CODES[weight.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise NativeError(f"the native GEMV refused N={n} K={k} {weight.dtype}")
    return y


def handles(t: torch.Tensor) -> bool:
    """The per-layer decode operations (`rmsnorm`, `norm_rope_`, `silu_mul`) can run on `t`."""
    return t.device.type == "cpu" and t.dtype in DTYPE_CODES and available()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise NativeError(f"the native {what} refused its arguments")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm over the last dimension: x (..., dim) -> (..., dim), weight (dim) of x's
    dtype; x's rows may be strided (a view), its last dimension contiguous."""
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise NativeError(f"rmsnorm weight {tuple(weight.shape)} {weight.dtype} for x {x.dtype}")
    x2 = x.reshape(-1, dim) if x.dim() != 2 else x  # (..., dim) -> (rows, dim), a view if it can
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype)
    rc = _library().tandem_rmsnorm(
        x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(), x2.shape[0], dim, eps,
        DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "rmsnorm")
    return y.view(x.shape)


def norm_rope_(
    t: torch.Tensor,
    heads: int,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """In place on t (rows, heads * head_dim), rows possibly strided (a split of the fused q/k/v
    output): per-head RMSNorm with `weight` (head_dim) when given, then rope.apply_rope with cos
    and signed sin (rows, head_dim) or any shape of that many elements, contiguous."""
    rows, width = t.shape
    hd = width // heads
    code = DTYPE_CODES[t.dtype]
    if (
        t.stride(1) != 1
        or hd * heads != width
        or cos.dtype != t.dtype
        or sin.dtype != t.dtype
        or cos.numel() != rows * hd
        or sin.numel() != rows * hd
        or not (cos.is_contiguous() and sin.is_contiguous())
        or (weight is not None and (weight.shape != (hd,) or weight.dtype != t.dtype))
    ):
        raise NativeError(
            f"norm_rope on {tuple(t.shape)} {t.dtype} with {heads} heads, cos {tuple(cos.shape)}"
        )
    rc = _library().tandem_norm_rope(
        t.data_ptr(), rows, heads, hd, t.stride(0),
        None if weight is None else weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), code,
        torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "norm_rope")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """layers.MLP's silu(gate) * up for the fused gate/up output (..., 2 * inter) -> (..., inter)."""
    inter = gate_up.shape[-1] // 2
    gu = gate_up.contiguous()
    y = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype)
    rc = _library().tandem_silu_mul(
        gu.data_ptr(),
        y.data_ptr(),
        gu.numel() // (2 * inter),
        inter,
        DTYPE_CODES[gu.dtype],
        torch.get_num_threads(),
    )
    _check(rc, "silu_mul")
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for x (..., n): the first maximum, a NaN counting as the maximum ->
    int64 (...)."""
    n = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    rc = _library().tandem_argmax(
        xc.data_ptr(), xc.numel() // n, n, out.data_ptr(), DTYPE_CODES[x.dtype]
    )
    _check(rc, "argmax")
    return out


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, keys, values) for one decode step with every key visible
    (no mask), grouped-query: q (B, G, R, hd) with rows possibly strided but each row's G*R heads
    contiguous (the roped projection output), keys / values (B, G, S, hd) with the last dimension
    contiguous (the cache's view) -> (B, G, R, hd) contiguous."""
    B, G, R, hd = q.shape
    S = keys.shape[2]
    if (
        keys.shape != (B, G, S, hd)
        or values.shape != keys.shape
        or not (q.dtype == keys.dtype == values.dtype)
        or keys.stride(-1) != 1
        or values.stride(-1) != 1
        or q.stride(3) != 1
        or q.stride(2) != hd
        or q.stride(1) != R * hd
    ):
        raise NativeError(f"decode attention on q {tuple(q.shape)}, keys {tuple(keys.shape)}")
    out = torch.empty((B, G, R, hd), dtype=q.dtype)
    ks = (ctypes.c_int64 * 3)(*keys.stride()[:3])
    vs = (ctypes.c_int64 * 3)(*values.stride()[:3])
    rc = _library().tandem_decode_attention(
        q.data_ptr(), q.stride(0), keys.data_ptr(), ks, values.data_ptr(), vs, out.data_ptr(),
        B, G, R, S, hd, hd**-0.5, DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "decode attention")
    return out


def stream_read(t: torch.Tensor) -> int:
    """Reads every byte of the contiguous CPU tensor `t` with 256-bit loads on torch's thread
    count (a read-bandwidth probe for benchmarks); returns a checksum of what it read."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_mkldnn:
        raise NativeError("stream_read takes a contiguous dense CPU tensor")
    return library().tandem_stream_read(
        t.data_ptr(), t.numel() * t.element_size(), torch.get_num_threads()
    )
