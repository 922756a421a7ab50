"""tandem's CPU decode kernels (`csrc/`), built on first use with the host's C compiler and
called through ctypes: no Python headers, no torch headers, a build of about a second.

- `gemv` (csrc/gemv.c): Y = X W^T for the decode-sized X (<= MAX_ROWS rows) of every linear layer,
  and (`gemv_unchecked`) for any X with the same row kernel: a row's result at any row count;
- `tandem_qgemv` (csrc/qgemv.c, called by quant.py): the same over GGUF block-quantized weights,
  for decode and prefill;
- `rmsnorm`, `norm_rope_`, `silu_mul`, `decode_attention`, `step_attention` (csrc/decode_ops.c):
  the small per-layer operations, one call each instead of 4-12 tensor ops, in the reference
  form's rounding (`step_attention`: a whole step's attention, every query row on its own);
  `argmax`, the greedy pick over a row of logits (torch's is single-threaded and converts 16-bit
  rows element by element: 0.6 ms for Qwen3's 151936 bf16 logits, ~0.1 here);
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

The build and the loading are `library.py`'s (torch-free); this module wraps the calls for
torch tensors and re-exports the library's names.

`available()` is False, with `why()` saying why, on anything but Linux on x86-64 with AVX2 + FMA,
without a compiler, when the build fails, or with `TANDEM_NATIVE=0`; the caller then keeps the
library kernels. Nothing here raises for an unavailable kernel; each operation raises
`NativeError` for arguments it cannot run.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tandem.kernels.library import (  # noqa: F401  (re-exported: the kernels' one entry point)
    _SIGNATURES,
    BUILD_TIMEOUT_S,
    CSRC,
    FLAGS,
    HEADERS,
    MAX_ROWS,
    SOURCES,
    NativeError,
    _compiler,
    _library,
    available,
    cache_dir,
    isa,
    library,
    why,
)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 1024  # csrc/decode_ops.c's bound on a head's width


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
        raise NativeError(f"the native GEMV is unavailable: {why()}")
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
        None if weight is None else weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), 0, code,
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


def step_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of a whole step, each query row over exactly the keys it sees: row b holds
    `lengths[b]` new queries at positions starts[b] ..., each attending causally to cache
    positions max(0, pos - window + 1) .. pos (`window` None: from 0), with `sinks` (H,) joining
    each head's softmax (models/attention.py's `sink_attention`). q (B, T, H, hd) with each
    row's heads contiguous (the roped projection output, rows possibly strided); keys / values
    (B, G, S, hd), S >= every starts[b] + lengths[b], the last dimension contiguous (the cache's
    view) -> (B, T, H, hd) contiguous, padded rows (t >= lengths[b]) zeros. Every row is
    csrc's attend_group, the decode and prefill calls' arithmetic: its output depends on its q
    and its visible keys and values, never on the other rows of the step."""
    B, T, H, hd = q.shape
    G, S = keys.shape[1], keys.shape[2]
    if (
        keys.shape != (B, G, S, hd)
        or values.shape != keys.shape
        or H % G
        or not (q.dtype == keys.dtype == values.dtype)
        or keys.stride(-1) != 1
        or values.stride(-1) != 1
        or q.stride(3) != 1
        or q.stride(2) != hd
        or len(starts) != B
        or len(lengths) != B
        or any(s < 0 or not 1 <= n <= T or s + n > S for s, n in zip(starts, lengths))
        or (window is not None and window < 1)
        or (sinks is not None and sinks.shape != (H,))
    ):
        raise NativeError(
            f"step attention on q {tuple(q.shape)}, keys {tuple(keys.shape)}, starts {starts}, "
            f"lengths {lengths}"
        )
    out = torch.empty((B, T, H, hd), dtype=q.dtype)
    i64 = ctypes.c_int64
    sinks32 = None if sinks is None else sinks.detach().float().contiguous()
    rc = _library().tandem_step_attention(
        q.data_ptr(), (i64 * 2)(*q.stride()[:2]), keys.data_ptr(), (i64 * 3)(*keys.stride()[:3]),
        values.data_ptr(), (i64 * 3)(*values.stride()[:3]), out.data_ptr(), B, T, G, H // G,
        (i64 * B)(*starts), (i64 * B)(*lengths), window or 0,
        None if sinks32 is None else sinks32.data_ptr(), hd, hd**-0.5, DTYPE_CODES[q.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "step attention")
    return out


def stream_read(t: torch.Tensor) -> int:
    """Reads every byte of the contiguous CPU tensor `t` with 256-bit loads on torch's thread
    count (a read-bandwidth probe for benchmarks); returns a checksum of what it read."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_mkldnn:
        raise NativeError("stream_read takes a contiguous dense CPU tensor")
    return library().tandem_stream_read(
        t.data_ptr(), t.numel() * t.element_size(), torch.get_num_threads()
    )


def deltanet_mix(
    proj: torch.Tensor,
    taps: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    window: torch.Tensor,
    state: torch.Tensor,
    y: torch.Tensor,
    heads: tuple[int, int, int, int],
    tiled: bool,
) -> None:
    """One sequence's T tokens through a Gated DeltaNet mixer (csrc/deltanet.c
    `tandem_deltanet_mix`, `models.deltanet`'s math): proj (T, P) rows of [qkv (C) | z (Hv dv) |
    b (Hv) | a (Hv)], taps (C, K), a = A (Hv,) < 0, dt_bias (Hv,), norm_w (dv,), all float32 ->
    y (T, Hv dv), the gated norm's output, written in place; window (C, K - 1) and state
    (Hv, dk, dv) updated in place. heads = (Hk, Hv, dk, dv); `tiled`: v head j served by q/k
    head j % Hk (a GGUF's order), else j // (Hv / Hk)."""
    Hk, Hv, dk, dv = heads
    C = 2 * Hk * dk + Hv * dv
    K = taps.shape[-1]
    T, P = proj.shape
    want = {
        "proj": (proj, (T, C + Hv * dv + 2 * Hv)), "taps": (taps, (C, K)), "a": (a, (Hv,)),
        "dt_bias": (dt_bias, (Hv,)), "norm_w": (norm_w, (dv,)), "window": (window, (C, K - 1)),
        "state": (state, (Hv, dk, dv)), "y": (y, (T, Hv * dv)),
    }  # fmt: skip
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise NativeError(
                f"deltanet mix: {name} {tuple(t.shape)} {t.dtype}, want {shape} float32 contiguous"
            )
    rc = _library().tandem_deltanet_mix(
        proj.data_ptr(), P, T, taps.data_ptr(), a.data_ptr(), dt_bias.data_ptr(),
        norm_w.data_ptr(), eps, window.data_ptr(), state.data_ptr(), y.data_ptr(), Hk, Hv, dk,
        dv, K, int(tiled), torch.get_num_threads(),
    )  # fmt: skip
    _check(rc, "deltanet mix")
