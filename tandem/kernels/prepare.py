"""`prepare(model)`: a reference model turned, in place, into its execution form on its device."""

from __future__ import annotations

from torch import nn

from tandem.kernels.linear import KERNELS, TORCH, KernelError, KernelReport, prepare_linear_kernels
from tandem.kernels.modules import swap_fast_modules
from tandem.kernels.moe import install_expert_kernels
from tandem.kernels.quant_linear import choose_variants


def prepare(
    model: nn.Module, *, kernel: str = "auto", tied_head: str = "auto", fuse: bool = True
) -> KernelReport:
    """Swaps the fast modules in (`modules.swap_fast_modules`, an MoE block's experts on the
    native call: `moe.install_expert_kernels`), then puts every linear layer on
    its kernel (`linear.prepare_linear_kernels`: fuses q/k/v and gate/up when `fuse`), and
    times which ISA build multiplies each GGUF weight type (`quant_linear.choose_variants`).
    `kernel="torch"` keeps the reference modules and F.linear: the plain math, unfused."""
    if kernel != "auto" and kernel not in KERNELS:
        raise KernelError(f"unknown kernel {kernel!r}; choose auto or one of {', '.join(KERNELS)}")
    if kernel != TORCH:
        swap_fast_modules(model)
        install_expert_kernels(model)
    report = prepare_linear_kernels(model, kernel=kernel, tied_head=tied_head, fuse=fuse)
    if kernel != TORCH:
        report.variants = choose_variants(model)  # each GGUF type's ISA build, by timing
    return report
