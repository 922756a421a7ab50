"""Which kernel computes `Y = X W^T + b` for the linear layers, chosen once per (device, dtype).

Decode at batch 1 is a chain of GEMVs bound by reading the weights. torch's default CPU path
(`F.linear` -> MKL sgemv / oneDNN on a plain bf16 layout) streams only about 40-45% of a plain
read on the x86 CPUs measured here, oneDNN's inner product reached directly 55-75%, and tandem's
own GEMV (`native.py`, `gemv.c`) 75-99%. The choice, per weight:

    kernel     when (CPU only)                               weight storage
    "native"   x86-64 Linux with AVX2+FMA and a C compiler:  the dense weight itself (no copy)
               float32, bfloat16, float16
    "onednn"   float32, x86 with oneDNN (no native build)    the dense weight itself (no copy)
    "packed"   bfloat16 on CPUs with avx512_bf16 or AMX      reordered once into oneDNN's blocked
               (no native build)                             layout (`_reorder_linear_weight`); the
                                                             dense tensor is dropped (same bytes)
    "torch"    anything else (GPUs, other CPUs)              unchanged, `F.linear`

"native" multiplies inputs of any number of rows with the same row kernel (csrc/gemv.c: the
decode GEMV for up to `native.MAX_ROWS` rows, and for more the same kernel over groups of that
many rows per cache-resident block of W), so a row's output is the same bits whether the step
holds 1 row or 500: batch invariance (issue 30: a sequence's greedy text must not depend on what
else the server runs). The price is prefill speed: the library GEMMs are register-tiled and,
on AMX, run bf16 in tiles. Measured (Sapphire Rapids with AMX, 2 threads, Qwen3-0.6B's matrices,
128-512 rows): float32 2.2-3x and bfloat16 6-14x the library's time per product.
`TANDEM_LIBRARY_PREFILL=1` gives inputs of more than `native.MAX_ROWS` rows back to the library
kernel for the weight as stored (and a prefill's attention to SDPA, `fast_attention.FastAttention`),
not batch-invariant: oneDNN for float32, `F.linear` for 16-bit
weights on a CPU with native bf16 dot products, and elsewhere `wide.f32_tiles_linear`: the weight
widened to float32 a tile of rows at a time (~1 MB, cache-resident) and multiplied by the float32
GEMM. On a CPU without avx512_bf16 / AMX, torch's bf16 GEMM converts in its inner loop and ran
4-5x slower than that (AVX2 EPYC, 64 x 1024 x 6144: 141 ms against 28 for the tiles, one thread),
so bf16 prefill was 0.21x llama.cpp's on a BF16 GGUF. The kernels of a CPU without the native
build ("onednn", "packed", "torch") are not batch-invariant either.

Measured (AMD EPYC Zen 4, AVX-512 + avx512_bf16, 2 threads, Qwen3-0.6B's per-token matrices,
GB/s of weights streamed, scripts/bench/gemv.py over six runs while a plain read of the same matrices gave
27-44): float32 F.linear 11-13, "onednn" 21-22, "native" 25-36; bfloat16 F.linear 11-13,
"packed" 17-25, "native" 22-33.

A packed weight is an opaque oneDNN tensor: it can be multiplied, not indexed or sliced. A tied LM
head shares its matrix with the embedding, which must stay dense for row look-ups ("native" and
"onednn" read the dense matrix in place, so the head simply shares it). For "packed", `tied_head`:
"share" keeps the head on the embedding's dense tensor ("torch" kernel); "copy" packs the head a
copy of its own (one more vocab x hidden matrix in memory); "auto" (the default) copies only when
the embedding is a lazily mapped checkpoint (compute dtype = stored dtype), and then releases its
resident pages: the embedding reads a few rows per step from the file, the packed head replaces
the pages the dense head would keep resident, so the resident set does not grow.

Every kernel produces the same mathematical result as F.linear; the summation order differs, so
float32 outputs differ from F.linear's in the last bits (~1e-7 relative).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import native
from tandem.kernels.quant_linear import QUANT, install_quant_kernels
from tandem.kernels.wide import (
    LIBRARY_PREFILL,
    _native_bf16_cpu,
    _onednn_cpu,
    _onednn_linear,
    _wide_kernel,
)

TORCH, ONEDNN, PACKED, NATIVE = "torch", "onednn", "packed", "native"
KERNELS = (TORCH, ONEDNN, PACKED, NATIVE)


class KernelError(ValueError):
    """A kernel that cannot run the given weight (wrong device or dtype, or unsupported here)."""


def choose_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """The measured-best kernel for a weight on `device` in `dtype` (see the module table)."""
    if torch.device(device).type != "cpu":
        return TORCH
    if dtype in native.DTYPE_CODES and native.available():
        return NATIVE
    if not _onednn_cpu():
        return TORCH
    if dtype == torch.float32:
        return ONEDNN
    if dtype == torch.bfloat16 and _native_bf16_cpu():
        return PACKED
    return TORCH


def pack_weight(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """The weight (out, in) as `kernel` wants it stored: reordered for PACKED, made contiguous for
    NATIVE (a copy only for a strided view), unchanged otherwise. A PACKED result is a new tensor
    of the same byte size; the caller drops the dense one."""
    if kernel not in KERNELS:
        raise KernelError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == TORCH:
        return weight
    if kernel == NATIVE:
        w = weight if weight.is_contiguous() else weight.contiguous()
        if not native.supports(w):
            raise KernelError(
                f"kernel 'native' cannot run a {w.dtype} weight on {w.device}"
                f"{'' if native.available() else ': ' + native.why()}"
            )
        return w
    if weight.device.type != "cpu" or not _onednn_cpu():
        raise KernelError(f"kernel {kernel!r} needs a CPU weight and oneDNN, got {weight.device}")
    if weight.is_mkldnn or kernel == ONEDNN:
        return weight
    if weight.dtype != torch.bfloat16:
        raise KernelError(f"kernel 'packed' takes bfloat16 weights, got {weight.dtype}")
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for a dense or packed weight: x (..., in) -> (..., out).

    Dispatches per call on the weight: packed -> oneDNN; a weight the native GEMV takes -> native,
    any number of rows (with LIBRARY_PREFILL only a decode-sized x, <= native.MAX_ROWS rows);
    dense float32 on an x86 CPU with oneDNN -> oneDNN on the dense weight; anything else ->
    F.linear. For a hot loop prefer `KernelLinear`, which decides once."""
    n = x.numel()
    if (
        weight.device.type == "cpu"
        and 0 < n
        and (not LIBRARY_PREFILL or n <= native.MAX_ROWS * x.shape[-1])
        and native.supports(weight)
    ):
        return native.gemv_unchecked(x, weight, None if bias is None else bias.float())
    if weight.is_mkldnn or (
        weight.dtype == torch.float32 and weight.device.type == "cpu" and _onednn_cpu()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def release_file_pages(t: torch.Tensor) -> int:
    """Drops this process's mapping of the whole pages under `t` when `t` lives in a memory-mapped
    file (a checkpoint read lazily by the loader), so that a weight that was just packed into a new
    buffer stops counting twice in the resident set. The file's pages stay in the page cache, and
    a later read of `t` faults them back in from the file, so this is safe only for a tensor nobody
    writes to in place: the loader's weights. Anonymous memory is never touched (dropping it would
    zero it). Linux only; elsewhere, or on any doubt, does nothing. Returns the bytes released."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.is_mkldnn:
        return 0
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    start, end = -(-lo // page) * page, hi // page * page  # whole pages inside [lo, hi)
    if end <= start or not _in_file_mapping(start, end):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, 4) != 0:  # MADV_DONTNEED
        return 0
    return end - start


def _is_mapped(t: torch.Tensor) -> bool:
    """`t` is a CPU tensor whose bytes lie in a mapped regular file."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.is_mkldnn:
        return False
    return _in_file_mapping(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def _in_file_mapping(start: int, end: int) -> bool:
    """[start, end) lies inside one mapping of a regular file (per /proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split(maxsplit=5)
        lo, _, hi = fields[0].partition("-")
        if int(lo, 16) <= start and end <= int(hi, 16):
            path = fields[5].strip() if len(fields) == 6 else ""
            return path.startswith("/") and not path.endswith("(deleted)") and Path(path).is_file()
    return False


class KernelLinear(nn.Module):
    """A drop-in for an inference-only `nn.Linear` whose kernel was chosen once: the same
    parameter names (`weight`, `bias`), so state-dict keys and tied weights stay as they were.
    x (..., in) -> (..., out)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str, in_features: int
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.kernel = kernel
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        self.bias = bias
        self._fn: Callable = F.linear if kernel == TORCH else _onednn_linear
        if kernel == NATIVE:
            self._fn = self._native
            self._wide = _wide_kernel(weight)
            self._bias32 = None if bias is None else bias.detach().float().contiguous()
            # x.numel() at most for the native GEMV: any, or decode only with LIBRARY_PREFILL
            self._rows = native.MAX_ROWS * in_features if LIBRARY_PREFILL else sys.maxsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x, self.weight, self.bias)

    def _native(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if 0 < x.numel() <= self._rows:
            return native.gemv_unchecked(x, w, self._bias32)  # (..., in) -> (..., out)
        return self._wide(x, w, b)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> the argmax id (...) int64 of this layer's output, ties to the lowest id."""
        y = self(x)
        return native.argmax(y) if native.handles(y) else y.argmax(-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


@dataclass
class KernelReport:
    """What `prepare_linear_kernels` did: layer counts per kernel and the weight bytes packed."""

    layers: dict[str, int] = field(default_factory=dict)
    fused: int = 0  # fused groups (q/k/v, gate/up)
    packed_bytes: int = 0
    copied_bytes: int = 0  # a packed copy of a tied head (tied_head "copy", or "auto" on a mapping)
    variants: dict | None = None  # the ISA build each GGUF weight type took (variant_choice)


def prepare_linear_kernels(
    model: nn.Module, *, kernel: str = "auto", tied_head: str = "auto", fuse: bool = True
) -> KernelReport:
    """Puts every `nn.Linear` in `model` on `kernel` ("auto": the measured-best per device and
    dtype, `choose_kernel`), in place; returns what it did. Inference only: the weights stop
    requiring grad. Works one matrix (or one fused group) at a time, so peak memory is the model
    plus one group.

    With `fuse`, a module that declares `FUSED = {fused_name: (part, ...)}` (attention's q/k/v,
    the MLP's gate/up) gets one `KernelLinear` `fused_name` over the row-stacked weights
    [W_part1; W_part2; ...] (biases likewise) and its parts set to None: one GEMV instead of several
    over the same bytes. A prepared model's state dict therefore names the fused weights; it is an
    execution form, not a checkpoint.

    A linear layer whose weight is shared with another module (a tied LM head) is handled per
    `tied_head` (module docstring: "auto", "share" or "copy"). Calling this again is a no-op.

    Layers holding GGUF blocks (the QuantLinear contract) go to the native quantized kernel
    (`quant_linear.install_quant_kernels`, fused likewise) for kernel "auto" or "native"; any other
    kernel, or no native build, keeps the reference modules."""
    if tied_head not in ("auto", "share", "copy"):
        raise KernelError(f"tied_head is 'auto', 'share' or 'copy', got {tied_head!r}")
    if kernel != "auto" and kernel not in KERNELS:
        raise KernelError(f"unknown kernel {kernel!r}; choose auto or one of {', '.join(KERNELS)}")
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    report = KernelReport()

    def pick(w: torch.Tensor) -> str:
        return choose_kernel(w.device, w.dtype) if kernel == "auto" else kernel

    def install(parent: nn.Module, leaf: str, w: torch.Tensor, b, k: str, shared: bool) -> None:
        if k == PACKED and not w.is_mkldnn:
            nbytes = w.numel() * w.element_size()
            w = pack_weight(w, k)
            if shared:
                report.copied_bytes += nbytes
            else:
                report.packed_bytes += nbytes
        else:
            w = pack_weight(w, k)  # validates the kernel against the weight (NATIVE: contiguous)
        for t in (w, b):
            if t is not None:
                t.requires_grad_(False)
        setattr(parent, leaf, KernelLinear(w, b, k, w.shape[1]))
        report.layers[k] = report.layers.get(k, 0) + 1

    # hold names, not modules: a replaced matrix is freed as soon as its layer is done
    if fuse:
        for mname in [n for n, m in model.named_modules() if getattr(type(m), "FUSED", None)]:
            mod = model.get_submodule(mname)
            for fused, parts in type(mod).FUSED.items():
                lins = [getattr(mod, n, None) for n in parts]
                if not _fusable(lins, owners):
                    continue
                with torch.no_grad():
                    w = torch.cat([lin.weight for lin in lins])  # (sum out, in)
                    b = None if lins[0].bias is None else torch.cat([lin.bias for lin in lins])
                for lin in lins:
                    release_file_pages(lin.weight)
                for n in parts:
                    setattr(mod, n, None)
                del lins
                install(mod, fused, w, b, pick(w), shared=False)
                report.fused += 1
    for name in [n for n, m in model.named_modules() if type(m) is nn.Linear]:
        lin = model.get_submodule(name)
        w = lin.weight
        k = pick(w)
        shared = owners[id(w)] > 1
        mapped = shared and k == PACKED and tied_head == "auto" and _is_mapped(w)
        if k == PACKED and shared and not (tied_head == "copy" or mapped):
            k = TORCH
        owner, _, leaf = name.rpartition(".")
        install(model.get_submodule(owner), leaf, w, lin.bias, k, shared)
        if k == PACKED and (mapped or not shared):
            release_file_pages(w)
        del lin, w
    if kernel in ("auto", NATIVE):  # GGUF-quantized layers: the native kernel over their blocks
        q = install_quant_kernels(model, fuse=fuse)
        if q[QUANT]:
            report.layers[QUANT] = report.layers.get(QUANT, 0) + q[QUANT]
            report.fused += q["quant_fused"]
    return report


def _fusable(lins: list, owners: dict[int, int]) -> bool:
    """Plain, unshared nn.Linear parts over the same input, dtype and device, all with or all
    without a bias."""
    if not lins or any(type(m) is not nn.Linear for m in lins):
        return False
    w0 = lins[0].weight
    return all(
        m.in_features == lins[0].in_features
        and m.weight.dtype == w0.dtype
        and m.weight.device == w0.device
        and not m.weight.is_mkldnn
        and (m.bias is None) == (lins[0].bias is None)
        and owners[id(m.weight)] == 1
        for m in lins
    )
