"""numpy faces of the native kernels (csrc/decode_ops.c, qgemv.c) for the torch-free path. Every
array is float32 on the host; each function checks what the C call would otherwise read past
(shapes, contiguity, dtype) and raises `LeanKernelError` for what it cannot run."""

from __future__ import annotations

import ctypes

import numpy as np

from tandem.kernels import library

F32 = 0  # csrc/dtypes.h DT_F32: the torch-free path computes in float32


class LeanKernelError(library.NativeError):
    """Arguments a native call refuses (shape, dtype, layout), or the library is unavailable."""


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _f32(a: np.ndarray, what: str, ndim: int = 2) -> None:
    if a.dtype != np.float32 or a.ndim != ndim or a.strides[-1] != 4:
        raise LeanKernelError(f"{what}: float32 {ndim}-d with a contiguous last dimension")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise LeanKernelError(f"the native {what} refused its arguments")


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, threads: int) -> np.ndarray:
    """layers.RMSNorm: x (N, D), rows possibly strided -> (N, D) contiguous; w (D,)."""
    _f32(x, "rmsnorm x")
    if w.shape != (x.shape[1],) or w.dtype != np.float32 or not w.flags.c_contiguous:
        raise LeanKernelError(f"rmsnorm weight {w.shape} {w.dtype} for width {x.shape[1]}")
    y = np.empty(x.shape, np.float32)
    rc = library.library().tandem_rmsnorm(
        _ptr(x), x.strides[0] // 4, _ptr(w), _ptr(y), x.shape[0], x.shape[1], eps, F32, threads
    )
    _check(rc, "rmsnorm")
    return y


def norm_rope_(
    x: np.ndarray,
    heads: int,
    w: np.ndarray | None,
    eps: float,
    cos: np.ndarray,
    sin: np.ndarray,
    threads: int,
    pairs: bool = False,
) -> None:
    """In place on x (N, heads * hd), rows possibly strided (a slice of the fused q/k/v output):
    the per-head RMSNorm with w (hd,) when given (Qwen3), then RoPE with this row's cos and signed
    sin (N, hd) contiguous; `pairs`: x, w and the tables in llama.cpp's pair order
    (`rope.cos_sin`)."""
    _f32(x, "norm_rope x")
    n, width = x.shape
    hd = width // heads
    if hd * heads != width or cos.shape != (n, hd) or sin.shape != (n, hd):
        raise LeanKernelError(f"norm_rope on {x.shape} with {heads} heads, cos {cos.shape}")
    for t in (cos, sin) + (() if w is None else (w,)):
        if t.dtype != np.float32 or not t.flags.c_contiguous:
            raise LeanKernelError("norm_rope tables and weight: contiguous float32")
    if w is not None and w.shape != (hd,):
        raise LeanKernelError(f"norm_rope weight {w.shape} for head_dim {hd}")
    rc = library.library().tandem_norm_rope(
        _ptr(x), n, heads, hd, x.strides[0] // 4, _ptr(w), eps, _ptr(cos), _ptr(sin), int(pairs),
        F32, threads,
    )  # fmt: skip
    _check(rc, "norm_rope")


def silu_mul(gu: np.ndarray, threads: int) -> np.ndarray:
    """gu (N, 2 * inter) = [gate, up] per row, contiguous -> silu(gate) * up (N, inter)."""
    _f32(gu, "silu_mul")
    if not gu.flags.c_contiguous or gu.shape[1] % 2:
        raise LeanKernelError(f"silu_mul takes contiguous (N, 2 * inter), got {gu.shape}")
    inter = gu.shape[1] // 2
    y = np.empty((gu.shape[0], inter), np.float32)
    rc = library.library().tandem_silu_mul(_ptr(gu), _ptr(y), gu.shape[0], inter, F32, threads)
    _check(rc, "silu_mul")
    return y


def gelu_tanh_mul(gu: np.ndarray, threads: int) -> np.ndarray:
    """gu (N, 2 * inter) = [gate, up] per row, contiguous -> gelu_tanh(gate) * up (N, inter)
    (Gemma's GeGLU, `layers.GeluTanhMLP`; csrc tandem_gelu_tanh_mul, float32, one rounding per
    operation): gelu_tanh(z) = z/2 (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))."""
    _f32(gu, "gelu_tanh_mul")
    if not gu.flags.c_contiguous or gu.shape[1] % 2:
        raise LeanKernelError(f"gelu_tanh_mul takes contiguous (N, 2 * inter), got {gu.shape}")
    inter = gu.shape[1] // 2
    y = np.empty((gu.shape[0], inter), np.float32)
    rc = library.library().tandem_gelu_tanh_mul(_ptr(gu), _ptr(y), gu.shape[0], inter, F32, threads)
    _check(rc, "gelu_tanh_mul")
    return y


def argmax(x: np.ndarray) -> np.ndarray:
    """x (B, V) contiguous -> the first maximum of each row (B,) int64 (a NaN counts as the
    maximum, as torch.argmax)."""
    _f32(x, "argmax")
    if not x.flags.c_contiguous:
        raise LeanKernelError("argmax takes a contiguous (B, V)")
    out = np.empty(x.shape[0], np.int64)
    _check(
        library.library().tandem_argmax(_ptr(x), x.shape[0], x.shape[1], _ptr(out), F32), "argmax"
    )
    return out


def qgemv(
    x: np.ndarray, parts: ctypes.Array, bias: np.ndarray | None, out_features: int, threads: int
) -> np.ndarray:
    """x (M, K) contiguous @ [W_0; W_1; ...]^T (+ bias) -> (M, out_features): csrc/qgemv.c over
    row-stacked GGUF parts (`quant.py`'s math and bound), any M. The caller (`linear.Linear`)
    has checked the parts and the bias once."""
    _f32(x, "qgemv x")
    if not x.flags.c_contiguous:
        raise LeanKernelError("qgemv takes a contiguous x")
    y = np.empty((x.shape[0], out_features), np.float32)
    rc = library.library().tandem_qgemv(
        _ptr(x), parts, len(parts), _ptr(bias), _ptr(y), x.shape[0], x.shape[1], F32, threads
    )
    _check(rc, "quantized GEMV")
    return y


def stream_read(a: np.ndarray, threads: int) -> int:
    """Reads every byte of the contiguous array `a` with 256-bit loads on `threads` threads (the
    read-bandwidth probe the benchmarks divide by); returns a checksum of what it read."""
    if not a.flags.c_contiguous:
        raise LeanKernelError("stream_read takes a contiguous array")
    return library.library().tandem_stream_read(_ptr(a), a.nbytes, threads)


def prefill_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    scale: float,
    threads: int,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal grouped-query attention (csrc/decode_ops.c) for the T new rows of one sequence at
    positions start..start+T-1: q (T, H * hd), rows possibly strided (a slice of the fused q/k/v
    output); k, v (G, >= start + T, hd) with the last dimension contiguous (the cache's slot, keys
    and values of these rows already written) -> (T, H * hd); query head h reads kv head
    h // (H / G). With a `window` (> 0) the row at position p sees keys max(0, p - window + 1)..p
    only; `sinks` (H,) float32: head h's sink logit joins its softmax without a value (gpt-oss);
    both through csrc's step attention, whose rows are the same function of their keys."""
    _f32(q, "attention q")
    G, S, hd = k.shape
    T, width = q.shape
    if (
        v.shape != k.shape
        or width % (G * hd)
        or S < start + T
        or k.dtype != np.float32
        or v.dtype != np.float32
        or k.strides[2] != 4
        or v.strides[2] != 4
    ):
        raise LeanKernelError(f"prefill attention on q {q.shape}, k {k.shape}, start {start}")
    out = np.empty((T, width), np.float32)
    if window or sinks is not None:
        H = width // hd
        if window < 0 or (
            sinks is not None
            and (sinks.shape != (H,) or sinks.dtype != np.float32 or not sinks.flags.c_contiguous)
        ):
            raise LeanKernelError(f"attention window {window}, sinks for {H} heads")
        qs = (ctypes.c_int64 * 2)(0, q.strides[0] // 4)
        ks3 = (ctypes.c_int64 * 3)(0, k.strides[0] // 4, k.strides[1] // 4)
        vs3 = (ctypes.c_int64 * 3)(0, v.strides[0] // 4, v.strides[1] // 4)
        starts, lens = (ctypes.c_int64 * 1)(start), (ctypes.c_int64 * 1)(T)
        rc = library.library().tandem_step_attention(
            _ptr(q), qs, _ptr(k), ks3, _ptr(v), vs3, _ptr(out), 1, T, G, width // (G * hd),
            starts, lens, window, _ptr(sinks), hd, scale, F32, threads,
        )  # fmt: skip
        _check(rc, "step attention")
        return out
    ks = (ctypes.c_int64 * 2)(k.strides[0] // 4, k.strides[1] // 4)
    vs = (ctypes.c_int64 * 2)(v.strides[0] // 4, v.strides[1] // 4)
    rc = library.library().tandem_prefill_attention(
        _ptr(q), q.strides[0] // 4, _ptr(k), ks, _ptr(v), vs, _ptr(out), T, G,
        width // (G * hd), start, hd, scale, F32, threads,
    )  # fmt: skip
    _check(rc, "prefill attention")
    return out
