"""The library kernels a linear layer falls back to for inputs too wide for tandem's native GEMV
(prefill with `TANDEM_LIBRARY_PREFILL=1`, `linear` module docstring), shared by the dense
(`linear.KernelLinear`) and the quantized (`quant_linear.QuantKernelLinear`) layers, below both:
oneDNN's inner product for a dense float32 weight on an x86 CPU, `F.linear` for a 16-bit weight
on a CPU with native bf16 dot products, and elsewhere `f32_tiles_linear` (the weight widened to
float32 a tile of rows at a time). Which the CPU offers is probed once (`_onednn_cpu`,
`_native_bf16_cpu`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

# prefill on the library GEMMs: faster, not batch-invariant (module docstring)
LIBRARY_PREFILL = os.environ.get("TANDEM_LIBRARY_PREFILL", "0") == "1"


@cache
def _onednn_cpu() -> bool:
    """oneDNN is built in, this is an x86 CPU with at least AVX2, and the pointwise op exists."""
    try:
        return (
            torch.backends.mkldnn.is_available()
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


@cache
def _native_bf16_cpu() -> bool:
    """The CPU computes bf16 dot products natively (avx512_bf16 or AMX), so oneDNN's bf16 GEMV
    runs at memory speed instead of converting every weight in software."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, c, lambda: False)() for c in checks)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


TILE_BYTES = 1 << 20  # float32 bytes of one widened weight tile: about an L2 cache


def f32_tiles_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, w, b) for a 16-bit weight w (N, K) on the CPU, computed in float32: x (..., K)
    widened once, w a tile of T rows at a time (T * K * 4 ~ TILE_BYTES), each tile's (T, M)
    product written into Y^T (N, M); the result (..., N) rounded once to x's dtype, as the 16-bit
    GEMM rounds its float32 accumulators. The weight stays 16-bit in memory."""
    N, K = w.shape
    x2 = x.reshape(-1, K).float()  # (M, K)
    yt = torch.empty((N, x2.shape[0]), dtype=torch.float32)  # Y^T (N, M)
    T = max(16, TILE_BYTES // (4 * K))
    for r in range(0, N, T):
        torch.mm(w[r : r + T].float(), x2.t(), out=yt[r : r + T])  # (T, K) x (K, M)
    if b is not None:
        yt += b.float()[:, None]
    y = torch.empty((x2.shape[0], N), dtype=x.dtype)
    y.copy_(yt.t())  # (M, N) row-major, rounded once to x's dtype
    return y.view(*x.shape[:-1], N)


def _wide_kernel(weight: torch.Tensor) -> Callable:
    """The library kernel for inputs too wide for the native GEMV (prefill): oneDNN for a dense
    float32 weight on an x86 CPU, the float32 tiles for a 16-bit weight on a CPU without native
    bf16 dot products, F.linear otherwise."""
    if weight.dtype == torch.float32:
        return _onednn_linear if _onednn_cpu() else F.linear
    if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
        return F.linear if _native_bf16_cpu() else f32_tiles_linear
    return F.linear
