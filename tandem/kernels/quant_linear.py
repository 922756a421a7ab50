"""The fast form of the reference quantized linear layer (`tandem.models.quant.linear.QuantLinear`):
`QuantKernelLinear` multiplies by the GGUF blocks as stored through the native kernels
(`quant.py`, csrc/qgemv.c), for decode (1-4 rows) and prefill (any rows) alike.

`install_quant_kernels` (called by `linear.prepare_linear_kernels`, which LocalExecutor and the
stage workers call) swaps every module with the QuantLinear contract (int `qtype`, uint8 buffer
`qweight` (out, row_bytes), `in_features`, `out_features`, `bias`) for a QuantKernelLinear over
the same tensor (no copy; a tied LM head keeps sharing the embedding's blocks). With `fuse`, a
module's `FUSED` group (q/k/v, gate/up) becomes one QuantKernelLinear over its parts stacked by
rows, each keeping its own type: one call, and the shape the two-call decode layer needs. When
the native build is unavailable (`TANDEM_NATIVE=0`, no compiler, not x86-64) or a weight has a
type or width the kernel lacks, the reference module stays.

Dense parts (F32, F16, BF16) take the kernel for every row count too (its one dense row kernel:
batch-invariant), unless `wide.LIBRARY_PREFILL`: then a prefill takes the library product,
the reference module's own math: `F.linear` on an F32 weight as x's dtype; an F16 / BF16 weight
through the kernel `wide._wide_kernel` picks for it (the float32 tiles where the CPU lacks
native bf16: the weight is not widened whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import native, quant, variant_choice, wide

QUANT = "quant"  # the kernel name in KernelReport.layers


def is_quant_linear(m: nn.Module) -> bool:
    """`m` follows the QuantLinear contract (module docstring) and is not already fast."""
    w = getattr(m, "qweight", None)
    return (
        not isinstance(m, QuantKernelLinear)
        and isinstance(getattr(m, "qtype", None), int)
        and isinstance(w, torch.Tensor)
        and w.dtype == torch.uint8
        and w.dim() == 2
        and isinstance(getattr(m, "in_features", None), int)
        and isinstance(getattr(m, "out_features", None), int)
    )


def _bias(m: nn.Module) -> torch.Tensor | None:
    b = getattr(m, "bias", None)
    return None if b is None else b.detach()


class QuantKernelLinear(nn.Module):
    """x (..., in) -> (..., out) in x's dtype over the row-stacked weights `parts`
    [(qweight, qtype), ...] (one for a plain layer) and an optional bias (out). Buffers `qweight`
    (one part) or `qweight0`, `qweight1`, ... (a fused group) hold the tensors as given."""

    def __init__(
        self,
        parts: list[tuple[torch.Tensor, int]],
        bias: torch.Tensor | None,
        in_features: int,
    ) -> None:
        super().__init__()
        self.parts = quant.Parts(parts, in_features)  # checks every weight (QuantKernelError)
        self.in_features, self.out_features = in_features, self.parts.out_features
        self.qtypes = self.parts.qtypes
        self.kernel = QUANT
        names = ["qweight"] if len(parts) == 1 else [f"qweight{i}" for i in range(len(parts))]
        for name, w in zip(names, self.parts.tensors):
            self.register_buffer(name, w, persistent=False)
        if bias is not None and bias.shape != (self.out_features,):
            raise quant.QuantKernelError(f"bias {tuple(bias.shape)} for {self.out_features} rows")
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._bias32 = None if bias is None else bias.detach().float().contiguous()
        self._rows = native.MAX_ROWS * in_features  # x.numel() at most for a decode call
        dense = any(t in quant.DENSE_TYPES for t in self.qtypes)
        self._any_rows = not (dense and wide.LIBRARY_PREFILL)  # the kernel at every row count

    @property
    def qtype(self) -> int:
        """The ggml type of a one-part layer (a fused group may mix types: `qtypes`)."""
        return self.qtypes[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if 0 < n and (n <= self._rows or self._any_rows) and x.dtype in native.DTYPE_CODES:
            return quant.matmul_unchecked(x, self.parts, self._bias32)
        return self._library(x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> the argmax id (...) int64 of this layer's output, ties to the lowest id
        (the greedy LM head: the native argmax over a vocabulary of logits)."""
        y = self(x)
        return native.argmax(y) if native.handles(y) else y.argmax(-1)

    def _library(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill with dense parts, or an input the kernel does not take: quantized parts through
        the kernel, dense ones through F.linear on the weight in x's dtype, then stacked."""
        if x.shape[-1] != self.in_features:
            raise quant.QuantKernelError(
                f"x has {x.shape[-1]} features, the weight {self.in_features}"
            )
        if x.numel() == 0:
            return x.new_zeros((*x.shape[:-1], self.out_features))
        outs = []
        for w, t, rows in zip(self.parts.tensors, self.qtypes, self.parts.rows):
            if t in quant.DENSE_TYPES:
                dense = w.view(_DENSE[t]).view(rows, self.in_features)  # (rows, in), no copy
                if wide._wide_kernel(dense) is wide.f32_tiles_linear:
                    outs.append(wide.f32_tiles_linear(x, dense))  # 16-bit, tile by tile
                else:
                    outs.append(F.linear(x, dense.to(x.dtype)))
            else:
                one = quant.Parts([(w, t)], self.in_features)
                outs.append(quant.matmul_unchecked(x.float(), one, None).to(x.dtype))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)  # (..., out)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        from tandem.models.quant.blocks import layout

        types = "+".join(layout(t).name for t in self.qtypes)
        return f"in={self.in_features}, out={self.out_features}, qtypes={types}, kernel=quant"


_DENSE = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def _fast(parts: list[nn.Module]) -> QuantKernelLinear | None:
    """The fast module over `parts` (one layer, or a fused group in row order), or None where the
    kernel cannot take them (the reference modules stay)."""
    k = parts[0].in_features
    biases = [_bias(m) for m in parts]
    if any(m.in_features != k for m in parts) or len({b is None for b in biases}) != 1:
        return None
    bias = None if biases[0] is None else torch.cat(biases)
    try:
        return QuantKernelLinear([(m.qweight, m.qtype) for m in parts], bias, k)
    except quant.QuantKernelError:
        return None


def install_quant_kernels(model: nn.Module, *, fuse: bool = True) -> dict[str, int]:
    """Swaps the model's QuantLinear modules for QuantKernelLinear in place (module docstring);
    returns {"quant": layers swapped, "quant_fused": fused groups}. A no-op (empty counts) without
    the native build. Calling it again finds nothing left to swap."""
    counts = {QUANT: 0, "quant_fused": 0}
    if not quant.available():
        return counts
    if fuse:
        for mname in [n for n, m in model.named_modules() if getattr(type(m), "FUSED", None)]:
            mod = model.get_submodule(mname)
            for fused, names in type(mod).FUSED.items():
                parts = [getattr(mod, n, None) for n in names]
                if not all(p is not None and is_quant_linear(p) for p in parts):
                    continue
                fast = _fast(parts)
                if fast is None:
                    continue
                for n in names:
                    setattr(mod, n, None)
                setattr(mod, fused, fast)
                counts[QUANT] += 1
                counts["quant_fused"] += 1
    for name in [n for n, m in model.named_modules() if is_quant_linear(m)]:
        owner, _, leaf = name.rpartition(".")
        fast = _fast([model.get_submodule(name)])
        if fast is not None:
            setattr(model.get_submodule(owner), leaf, fast)
            counts[QUANT] += 1
    return counts


@dataclass(frozen=True)
class _Projection:  # variant_choice.Projection over a QuantKernelLinear's parts
    parts: object
    types: tuple[int, ...]
    in_features: int
    out_features: int


def choose_variants(model: nn.Module) -> dict | None:
    """The ISA build each GGUF weight type of `model`'s quantized layers takes, timed on those
    layers (`variant_choice.choose`) and routed; None where it has none or no native kernels."""
    lins = [m for m in model.modules() if isinstance(m, QuantKernelLinear)]
    if not lins or not native.available():
        return None
    projections = [_Projection(m.parts.array, m.qtypes, m.in_features, m.out_features)
                   for m in lins]  # fmt: skip
    return variant_choice.choose(projections, torch.get_num_threads())
