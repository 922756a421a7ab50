"""The native kernels' shared library (`csrc/`): compiled on first use with the host's C compiler,
once per ISA variant this host runs (`cpu_isa.py`: AVX2, AVX-VNNI, AVX-512 VNNI), cached, loaded
through ctypes with every function's signature declared. Torch-free, so that both the torch
wrappers (`native.py`, `quant.py`, the decode modules) and the torch-free single-node path
(`tandem.kernels.lean`) load one and the same library.

The build: `$CC` (else `cc`, else `gcc`) with `-O3 <the variant's -march flags> -fopenmp
-ffp-contract=off` (no fused multiply-add where the reference form rounds twice), each source an
object of its own, every (variant, source) pair compiled in parallel over this host's CPUs, then
linked per variant into `$TANDEM_CACHE/native/<key>/` (default `~/.cache/tandem`), where the key
hashes the sources, the compiler's version and the variant's flags. Each library is written to a
private temporary file and renamed into place, so ranks that start together on one host never
load a half-written file. Loaded after torch, the OpenMP runtime it links (`libgomp.so.1`) is
the one torch already loaded; loaded without torch, it brings its own.

`library()` is the *primary* build: AVX2 (or the variant `TANDEM_KERNEL_VARIANT` forces): on
the Sapphire Rapids VM measured, the AVX-512 build's norms, attention and layer chains around
routed AVX2 GEMVs decoded SmolLM2 slower than the AVX2 build alone (BENCHMARKS.md). Its non-GEMV kernels (norms, attention, the layer chains) run as
they are; its quantized GEMV (`tandem_qgemv`) hands each call to the variant the timing chose for
the call's type and shape class (`route`, csrc/qgemv.c; chosen by `variant_choice.py`), and a
dense type's decode runs there in the form the timing chose (`ONE_ROW`). Unrouted, the primary
multiplies itself, every build in its default form. `variant_library(name)` loads one variant on its own (tests run
every variant against the reference), and `using(name)` makes it the primary for a block.

`available()` is False, with `why()` saying why, on anything but Linux on x86-64 with AVX2 + FMA
enabled by the OS, without a compiler, when the build fails, with `TANDEM_NATIVE=0`, or with a
`TANDEM_KERNEL_VARIANT` this host does not run.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from tandem.kernels import cpu_isa
from tandem.models.quant.blocks import BY_NAME, UnsupportedTypeError, layout

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / c
    for c in (
        "gemv.c", "decode_ops.c", "decode_block.c", "decode_model.c", "decode_token.c", "qgemv.c",
        "qgemm.c", "qgemm256.c", "gemm_dense256.c", "gemm_dense512.c", "moe.c", "sigbus.c",
        "build_info.c", "deltanet.c", "q8x.c",
    )
)  # fmt: skip
HEADERS = tuple(
    CSRC / h
    for h in (
        "dtypes.h", "quant.h", "canon.h", "qx.h", "qdot256.h", "qdot512.h", "qgemm_drive.h",
        "dense_drive.h", "decode_layers.h", "runs.h",
    )
)  # fmt: skip
BASE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC")  # every variant's, before -march
FLAGS = (*BASE_FLAGS, "-march=native", "-shared")  # one host-wide build (scripts/bench A/B tests)
FORCE_ENV = "TANDEM_KERNEL_VARIANT"  # a variant name: that build alone, no routing (benchmarks)
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
# tandem's own layouts, never in a file: type id -> (name, the file type whose bytes it repacks
# row by row into the same row bytes). Q8_0X: csrc/quant.h, made by tandem/kernels/repack.py.
REPACKED = {60: ("Q8_0X", "Q8_0")}
MAX_PARTS = 16  # csrc/qgemv.c: weights per call


def type_id_of(name: str) -> int:
    """The type id of a kernel type's name: a GGUF type's, or one of tandem's REPACKED."""
    own = [t for t, (n, _) in REPACKED.items() if n == name]
    return own[0] if own else BY_NAME[name].type_id


def kernel_row_bytes(type_id: int, in_features: int) -> tuple[str, int]:
    """(type name, bytes per row) of a weight of ggml type `type_id`, `in_features` columns wide,
    as csrc/qgemv.c multiplies it; `NativeError` for a type it lacks or a width that is not whole
    blocks (of 32 too, the activations' quantization group). Each caller checks its own array
    (torch or numpy) against the row bytes."""
    if type_id in REPACKED:
        name, of = REPACKED[type_id]
        cols = kernel_row_bytes(BY_NAME[of].type_id, in_features)[1]
        return name, cols
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


@cache
def _compiler_version(cc: str) -> str:
    return subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout


def source_hash(cc: str) -> str:
    """The sources' and the compiler's hash: what a build and a timed choice are keyed on."""
    digest = hashlib.sha256(_compiler_version(cc).encode())
    for f in (*SOURCES, *HEADERS):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def _target(cc: str, flags: tuple[str, ...]) -> Path:
    key = hashlib.sha256((source_hash(cc) + " ".join(flags)).encode()).hexdigest()[:16]
    return cache_dir() / key / "libtandem_native.so"


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if r.returncode != 0:
        raise OSError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-400:]}")


def _build(cc: str, builds: dict[str, tuple[str, ...]]) -> dict[str, Path]:
    """{variant: library path} for `builds` {variant: flags}: from the cache, else every
    missing (variant, source) object compiled in parallel, then each variant linked."""
    out = {name: _target(cc, flags) for name, flags in builds.items()}
    if all(p.exists() for p in out.values()):
        return out
    cache_dir().mkdir(parents=True, exist_ok=True)
    # one builder at a time per cache: processes started together (a pipeline's stages, a TP
    # group's workers) wait for the first one's build instead of each compiling every variant
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = {name: flags for name, flags in builds.items() if not out[name].exists()}
        if todo:
            _compile(cc, todo, out)
    return out


def _compile(cc: str, todo: dict[str, tuple[str, ...]], out: dict[str, Path]) -> None:
    """Every (variant, source) object of `todo` compiled in parallel, each variant linked to
    its `out` path (renamed into place whole)."""
    with tempfile.TemporaryDirectory(prefix="tandem-build-") as tmp:
        jobs = [
            [cc, *BASE_FLAGS, *flags, "-c", "-o", f"{tmp}/{name}-{src.stem}.o", str(src)]
            for name, flags in todo.items()
            for src in SOURCES
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_run, jobs))  # re-raises the first failure
        for name, flags in todo.items():
            dest = out[name]
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, lib = tempfile.mkstemp(dir=dest.parent, prefix=".build-", suffix=".so")
            os.close(fd)
            try:
                objs = [f"{tmp}/{name}-{src.stem}.o" for src in SOURCES]
                _run([cc, *BASE_FLAGS, *flags, "-shared", "-o", lib, *objs, "-lm"])
                os.replace(lib, dest)  # atomic: a reader sees no half-written library
            finally:
                if os.path.exists(lib):
                    os.unlink(lib)


_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # C function -> (return type, argument types); see csrc/ for the meaning
    "tandem_gemv_isa": (_INT, ()),
    # x, w, bias32, y, M, N, K, dtype, threads
    "tandem_gemv": (_INT, (_P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT)),
    "tandem_stream_read": (ctypes.c_uint64, (_P, _I64, _INT)),
    "tandem_evict": (None, (_P, _I64)),  # p, nbytes: out of every cache level (CLFLUSH)
    # src, dst (may be src), rows, K, threads: Q8_0 rows to GT_Q8_0X (csrc/q8x.c) and back
    "tandem_q8x_pack": (_INT, (_P, _P, _I64, _I64, _INT)),
    "tandem_q8x_unpack": (_INT, (_P, _P, _I64, _I64, _INT)),
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
    # the same with window and sinks (float32 per head or NULL) after pos
    "tandem_attention_block_ws": (
        _INT,
        (_P, _P, _F32, _P, _P, _P, _F32, _P, _P, _INT, _P, _P, _P, _I64, _I64, _P)
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
    # the same with router_kind (0 softmax_topk, 1 topk_softmax) before norm, act (tq_moe_act*)
    # before out
    "tandem_moe_block_act": (
        _INT,
        (_P, _I64, _P, _F32, _P, _I64, _I64, _INT, _INT, _I64, _I64, _I64, _I64, _P, _P, _P)
        + (_I64, _I64, _I64, _P, _P, _INT, _INT),
    ),
    # layer (tq_moe_layer*), h, M, norm_w, eps, D, out, dtype, threads
    "tandem_moe_layer": (_INT, (_P, _P, _I64, _P, _F32, _I64, _P, _INT, _INT)),
    # logits, M, E, k, kind, norm, ids, w32, dtype
    "tandem_moe_route_kind": (_INT, (_P, _I64, _I64, _I64, _INT, _INT, _P, _P, _INT)),
    # h, norm_w, eps, gate_up (tq_linear*), down (tq_linear*), out, D, I, dtype, threads
    "tandem_mlp_block": (_INT, (_P, _P, _F32, _P, _P, _P, _I64, _I64, _INT, _INT)),
    # the same with act (0 silu, 1 gelu_tanh) before dtype
    "tandem_mlp_block_act": (_INT, (_P, _P, _F32, _P, _P, _P, _I64, _I64, _INT, _INT, _INT)),
    # gu, y, rows, inter, dtype, threads
    "tandem_gelu_tanh_mul": (_INT, (_P, _P, _I64, _I64, _INT, _INT)),
    # layers (tq_layer*), n, h, cos, sin, cos_local, sin_local, slot, slot_stride, kv_strides,
    # pos, D, H, G, hd, I, scale, dtype, threads
    "tandem_decode_layers": (
        _INT,
        (_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64)
        + (_F32, _INT, _INT),
    ),
    # plan (tq_decode_plan*), token, slot, pos, cos, sin, cos_local, sin_local, logits, greedy
    # -> argmax id, 0, or -1
    "tandem_decode_token": (_I64, (_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _INT)),
    "tandem_embed_type_native": (_INT, (_I64,)),  # ggml type -> 1 where decode_token embeds it
    # base, length, file name, exit code (csrc/sigbus.c; tandem/kernels/mapped_guard.py)
    "tandem_watch_mapping": (_INT, (_P, _I64, ctypes.c_char_p, _INT)),
    "tandem_unwatch_mappings": (None, ()),
}


# proj, proj_stride, T, conv_w, A, dt_bias, norm_w, eps, window, state, y, Hk, Hv, dk, dv, K,
# tiled, threads (csrc/deltanet.c; tandem/kernels/lean/deltanet.py)
_SIGNATURES["tandem_deltanet_mix"] = (
    _INT,
    (_P, _I64, _I64, _P, _P, _P, _P, _F32, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _INT),
)
# h, in_norm, eps, in (tq_linear*), out (tq_linear*), conv_w, A, dt_bias, norm_w, norm_eps,
# window, state, out, D, Hk, Hv, dk, dv, K, tiled, threads
_SIGNATURES["tandem_deltanet_step"] = (
    _INT,
    (_P, _P, _F32, _P, _P, _P, _P, _P, _P, _F32, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64)
    + (_INT, _INT),
)
_SIGNATURES["tandem_qgemv_route"] = (_INT, (_INT, _I64, _P))  # class, ggml type, build's qgemv
_SIGNATURES["tandem_qgemv_routed"] = (_P, (_INT, _I64))  # class, ggml type -> that build or NULL
_SIGNATURES["tandem_build_features"] = (_INT, ())  # csrc/cpu_probe.c's bits this build uses
_SIGNATURES["tandem_dense_form"] = (_INT, (_I64, _INT))  # ggml type, form (else read) -> in force


class VariantError(NativeError):
    """A kernel variant this host cannot run, or one no build has."""


@cache
def _host() -> tuple[str, int] | None:
    """(the compiler, csrc/cpu_probe.c's feature bits), or None with `_why` set."""
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
        features = cpu_isa.host_features(cc, cache_dir())
    except cpu_isa.ProbeError as e:
        _why[0] = str(e)
        return None
    if not features & cpu_isa.AVX2:
        _why[0] = "this CPU (or its OS) lacks AVX2 + FMA + F16C"
        return None
    return cc, features


def features() -> int:
    """csrc/cpu_probe.c's feature bits for this host (0 where the kernels are unavailable)."""
    h = _host()
    return 0 if h is None else h[1]


def variants() -> tuple[str, ...]:
    """The variants this host runs, narrowest first (empty where the kernels are unavailable)."""
    return tuple(v.name for v in cpu_isa.runnable(features()))


def forced() -> str | None:
    """The variant `TANDEM_KERNEL_VARIANT` forces, or None."""
    return os.environ.get(FORCE_ENV) or None


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@cache
def _libraries() -> dict[str, ctypes.CDLL] | None:
    """Every variant this run may use, loaded ({forced} alone when one is forced)."""
    h = _host()
    if h is None:
        return None
    cc, feats = h
    names = variants()
    if forced() is not None:
        if forced() not in names:
            known = ", ".join(v.name for v in cpu_isa.VARIANTS)
            _why[0] = (
                f"{FORCE_ENV}={forced()}: this host runs {', '.join(names)} (variants: {known})"
            )
            return None
        names = (forced(),)
    builds = {n: cpu_isa.BY_NAME[n].flags(feats) for n in names}
    try:
        paths = _build(cc, builds)
        libs = {n: _load(paths[n]) for n in names}
    except (OSError, subprocess.SubprocessError) as e:
        _why[0] = f"build failed: {e}"
        return None
    _why[0] = ""
    return libs


SHAPE_CLASSES = ("decode", "prefill")  # csrc/qgemv.c's route classes: M <= MAX_ROWS, M > MAX_ROWS
ROUTE_TYPES = 64  # csrc/qgemv.c's TQ_ROUTE_TYPES: ggml type ids a route may name
# csrc/qgemv.c's tandem_dense_form: a dense type's decode as 2 rows of W a step with software
# prefetch (form 0), or one row, the hardware prefetcher alone (form 1, a kernel named
# "<variant>/1row"); the same bits either way
ONE_ROW = "1row"

_override: list[ctypes.CDLL | None] = [None]


def _library() -> ctypes.CDLL | None:
    """The primary build (module docstring), or the one `using` put in its place."""
    if _override[0] is not None:
        return _override[0]
    libs = _libraries()
    return None if libs is None else libs[primary()]


def primary() -> str:
    """The primary build's variant: the forced one, else AVX2 (module docstring)."""
    libs = _libraries()
    if libs is None:
        raise NativeError(f"the native kernels are unavailable: {_why[0]}")
    return next(iter(libs))  # narrowest first: avx2, or the one forced


def variant_library(name: str) -> ctypes.CDLL:
    """The build of variant `name` (`VariantError` where this host or this run lacks it)."""
    libs = _libraries()
    if libs is None:
        raise NativeError(f"the native kernels are unavailable: {_why[0]}")
    if name not in libs:
        raise VariantError(f"no {name} build here (this run has {', '.join(libs)})")
    return libs[name]


def kernel_name(variant: str, form: int) -> str:
    """The name of variant `variant`'s build decoding dense types in `form` (ONE_ROW)."""
    return f"{variant}/{ONE_ROW}" if form == 1 else variant


def split_kernel(name: str) -> tuple[str, int]:
    """`kernel_name`'s inverse: (variant, dense decode form)."""
    variant, _, form = name.partition("/")
    if form not in ("", ONE_ROW):
        raise VariantError(f"no kernel form {form!r} (forms: {ONE_ROW})")
    return variant, int(form == ONE_ROW)


def set_dense_form(name: str, type_id: int, form: int) -> None:
    """Variant `name`'s build decodes dense `type_id` in `form` (0 or 1)."""
    if variant_library(name).tandem_dense_form(type_id, form) != form:
        raise NativeError(f"csrc/qgemv.c has no decode form {form} for type {type_id}")


@contextlib.contextmanager
def unrouted() -> Iterator[None]:
    """Within the block every build multiplies its own calls in its default forms (the
    primary's routes and every build's dense decode forms are lifted and put back after): what
    a variant's timing and its tests must run."""
    libs = _libraries() or {}
    lib = libs.get(primary()) if libs else None
    saved, forms = [], []
    if lib is not None:
        for c in range(len(SHAPE_CLASSES)):
            for t in range(ROUTE_TYPES):
                ptr = lib.tandem_qgemv_routed(c, t)
                if ptr:
                    saved.append((c, t, ptr))
                    lib.tandem_qgemv_route(c, t, None)
    for build in libs.values():
        for t in DENSE_TYPES:
            forms.append((build, t, build.tandem_dense_form(t, -1)))
            build.tandem_dense_form(t, 0)
    try:
        yield
    finally:
        for c, t, ptr in saved:
            lib.tandem_qgemv_route(c, t, ptr)
        for build, t, form in forms:  # every form as it was, whatever the block set
            build.tandem_dense_form(t, form)


@contextlib.contextmanager
def using(name: str) -> Iterator[ctypes.CDLL]:
    """Within the block, `library()` is variant `name`'s build, unrouted (tests run each
    variant's kernels through the usual wrappers)."""
    lib = variant_library(name)
    before = _override[0]
    _override[0] = lib
    try:
        with unrouted():
            yield lib
    finally:
        _override[0] = before


def route(type_id: int, shape_class: str, name: str | None) -> None:
    """The primary's quantized GEMV hands calls of `type_id` in `shape_class` to kernel
    `name`'s build (None, or the primary's own variant: itself); a dense type's decode takes
    the name's form there (`kernel_name`; a type of another class or kind: its one form)."""
    libs = _libraries()
    if libs is None:
        raise NativeError(f"the native kernels are unavailable: {_why[0]}")
    lib = libs[primary()]
    variant, form = split_kernel(name) if name is not None else (primary(), 0)
    if form and (shape_class != "decode" or type_id not in DENSE_TYPES):
        raise VariantError(f"{name}: the {ONE_ROW} form is a dense type's decode")
    target = None
    if variant != primary():
        fn = variant_library(variant).tandem_qgemv
        target = ctypes.cast(fn, ctypes.c_void_p).value
    if lib.tandem_qgemv_route(SHAPE_CLASSES.index(shape_class), type_id, target) != 0:
        raise NativeError(f"csrc/qgemv.c cannot route type {type_id}")
    if shape_class == "decode" and type_id in DENSE_TYPES:  # the other builds back to form 0
        for other in libs:
            set_dense_form(other, type_id, form if other == variant else 0)


def routed(type_id: int, shape_class: str) -> str:
    """The kernel (`kernel_name`) the primary hands `type_id`'s `shape_class` calls to."""
    libs = _libraries()
    if libs is None:
        raise NativeError(f"the native kernels are unavailable: {_why[0]}")
    ptr = libs[primary()].tandem_qgemv_routed(SHAPE_CLASSES.index(shape_class), type_id)
    variant = primary()
    for name, lib in libs.items():
        if ptr and ctypes.cast(lib.tandem_qgemv, ctypes.c_void_p).value == ptr:
            variant = name
    dense_decode = shape_class == "decode" and type_id in DENSE_TYPES
    form = libs[variant].tandem_dense_form(type_id, -1) if dense_decode else 0
    return kernel_name(variant, form)


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
