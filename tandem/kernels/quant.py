"""`Y = X W^T` with W held as GGUF blocks, as stored (csrc/qgemv.c through ctypes): the decode
GEMV for 1-4 rows and the prefill product for any number of rows, neither making a dequantized
copy of W.

W `(out, in)` of ggml type `qtype` is a uint8 tensor `(out, row_bytes)` (`blocks.row_bytes`),
possibly a view of the memory-mapped file. A linear layer may be several such weights stacked by
rows, each of its own type (a fused q/k/v whose v is Q6_K and q, k Q4_K): `Parts` holds them for
one call.

The math (csrc/qgemv.c): each row of X is quantized per block of 32 to int8 with scale
dx = max|x| / 127; every weight block is decoded in registers and multiplied with integer dot
products; scales and the sum over blocks are float32. So the result is X' W^T for the rounded
activations X' (|x - x'| <= dx / 2 per element) up to float32 rounding: per output,

    |y - x.w| <= sum_b (dx_b / 2) sum_{i in b} |w_i|  +  (K/32 + 8) 2^-23 sum_i (|a_i| + |o_i|) |x_i|

where w_i = a_i + o_i splits a weight into its scaled quant and its block offset
(tests/unit/test_quant_gemv.py derives the bound and checks it per type). F32, F16 and BF16
weights are widened in registers and multiplied by X as given (float32 rounding only). The
result is cast once to x's dtype; bf16/f16 x is widened to float32 first (exact).

Prefill quantizes X the same way, once per call. Where every part is block-quantized and X has
enough rows (5 with AVX-512 VNNI, csrc/qgemm.c; 16 on AVX2, csrc/qgemm256.c, which also takes
K-quant-only calls first on an AMD AVX-512 CPU), each thread decodes a chunk of W's rows once
into a transposed form and multiplies it against tiles of X's rows; dense parts run register
tiles, csrc/gemm_dense512.c's (4 rows of W by 6 of X) on AVX-512, gemm_dense256.c's (2 by 6) on
AVX2;
otherwise each thread takes a cache-resident block of W's rows and runs the decode kernels over
every group of 4 rows of X. Either way W streams from memory once per call, and the same bound
holds.

Every function raises `QuantKernelError` (a `NativeError`) for a weight or input it cannot run
(wrong width, type, dtype, layout) and for an unavailable build (`native.why()`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.kernels import native
from tandem.kernels.cstructs import TqPart as _Part
from tandem.kernels.library import (  # noqa: F401  (re-exported)
    DENSE_TYPES,
    KERNEL_NAMES,
    KERNEL_TYPES,
    MAX_PARTS,
    kernel_row_bytes,
)


class QuantKernelError(native.NativeError):
    """A quantized weight or input the native kernel cannot run (type, shape, dtype, layout), or
    the kernel is unavailable."""


def available() -> bool:
    """The native build is loaded (see native.available / native.why)."""
    return native.available()


def check_weight(qweight: torch.Tensor, qtype: int, in_features: int) -> None:
    """Raises QuantKernelError unless `qweight` is W (rows, in_features) of type `qtype` as the
    kernel reads it: uint8 (rows, row_bytes), contiguous, on the CPU, of a type in KERNEL_TYPES."""
    try:
        name, want = kernel_row_bytes(qtype, in_features)
    except native.NativeError as e:
        raise QuantKernelError(str(e)) from None
    if (
        qweight.dtype != torch.uint8
        or qweight.dim() != 2
        or qweight.shape[1] != want
        or qweight.shape[0] < 1
    ):
        raise QuantKernelError(
            f"{name} weight of {in_features} columns must be uint8 (rows, {want}), got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    if qweight.device.type != "cpu" or not qweight.is_contiguous():
        raise QuantKernelError("the quantized weight must be a contiguous CPU tensor")


class Parts:
    """Weights stacked by rows for one kernel call: `weights` [(qweight, qtype), ...], each checked
    (check_weight) for `in_features` columns. Holds the tensors, so their memory outlives the
    pointers handed to C. `out_features` is the sum of their rows."""

    def __init__(self, weights: Sequence[tuple[torch.Tensor, int]], in_features: int) -> None:
        if not 1 <= len(weights) <= MAX_PARTS:
            raise QuantKernelError(f"1..{MAX_PARTS} weights per call, got {len(weights)}")
        for w, t in weights:
            check_weight(w, t, in_features)
        self.tensors = tuple(w for w, _ in weights)
        self.qtypes = tuple(int(t) for _, t in weights)
        self.in_features = in_features
        self.rows = tuple(int(w.shape[0]) for w in self.tensors)
        self.out_features = sum(self.rows)
        self.array = (_Part * len(weights))(
            *(_Part(w.data_ptr(), r, t) for w, r, t in zip(self.tensors, self.rows, self.qtypes))
        )


def matmul(
    x: torch.Tensor, parts: Parts, bias32: torch.Tensor | None = None, *, max_rows: int = 0
) -> torch.Tensor:
    """x (..., in) @ [W_0; W_1; ...]^T (+ bias32) -> (..., out) in x's dtype (float32, bfloat16
    or float16), any number of rows (`max_rows` > 0 refuses more). `bias32`: float32 (out) or
    None."""
    if not native.available():
        raise QuantKernelError(f"the native quantized GEMV is unavailable: {native.why()}")
    k = parts.in_features
    if x.shape[-1] != k:
        raise QuantKernelError(f"x has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in native.DTYPE_CODES or x.device.type != "cpu":
        raise QuantKernelError(f"x must be a CPU float32/bfloat16/float16 tensor, got {x.dtype}")
    rows = x.numel() // k
    if rows < 1 or (max_rows and rows > max_rows):
        raise QuantKernelError(f"x has {rows} rows; this call takes 1..{max_rows or 'any'}")
    if bias32 is not None and (
        bias32.shape != (parts.out_features,)
        or bias32.dtype != torch.float32
        or not bias32.is_contiguous()
    ):
        raise QuantKernelError(f"the bias must be contiguous float32 ({parts.out_features},)")
    return matmul_unchecked(x, parts, bias32)


def matmul_unchecked(x: torch.Tensor, parts: Parts, bias32: torch.Tensor | None) -> torch.Tensor:
    """`matmul` for arguments the caller has checked once (the module's hot path): x of
    parts.in_features columns, a supported dtype, on the CPU. The width is checked anyway: a
    wider x would read as more rows and overrun y."""
    k = parts.in_features
    if x.shape[-1] != k:
        raise QuantKernelError(f"x has {x.shape[-1]} features, the weight {k}")
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], parts.out_features), dtype=x.dtype)  # (..., in) -> (..., out)
    rc = native.library().tandem_qgemv(
        x.data_ptr(), parts.array, len(parts.rows),
        None if bias32 is None else bias32.data_ptr(), y.data_ptr(), x.numel() // k, k,
        native.DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise QuantKernelError(f"the native quantized GEMV refused {parts.qtypes} K={k}")
    return y


def gemv(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The decode GEMV: x (..., in) with 1..native.MAX_ROWS rows @ W^T (+ bias) -> (..., out) in
    x's dtype, W `qweight` of ggml type `qtype`. Checks every argument on every call; a module
    builds `Parts` once instead."""
    parts = Parts([(qweight, qtype)], x.shape[-1])
    b32 = None if bias is None else bias.detach().float().contiguous()
    return matmul(x, parts, b32, max_rows=native.MAX_ROWS)
