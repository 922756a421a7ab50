"""`FastExperts`: the reference `models.moe.Experts` whose forward runs every chosen expert of every
token in one native call (csrc/moe.c): each held expert's tokens gathered into one product over its
stacked weights as stored (GGUF blocks, or dense f32/bf16/f16), so only the chosen experts' weights
are read, once per step however many tokens chose them. A TP rank whose expert cut differs by
expert (`parallel.expert_split`) holds one `Experts` per group of uniform width: one call each.

Taken once `prepare` has put the model on a kernel other than "torch" (`install_expert_kernels`
sets `native`; the reference modules stay the plain math otherwise, even where a runner swapped
the fast classes in), where the native build is loaded, x is a contiguous CPU tensor of a kernel dtype and each of
the three projections is a `QuantExpertLinear` whose type the quantized GEMV has a kernel for, or a
dense `ExpertLinear` of a kernel dtype; anything else keeps the reference loop over experts.
gpt-oss's experts (biases, the clamped SwiGLU) go to the same call with their `tq_moe_act`. The
result is the reference's up to the GEMV's own rounding (int8 activations for quantized experts,
float32 summation order for dense ones: `tests/unit/test_moe_kernels.py`).
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels import native
from tandem.kernels.cstructs import TqMoeAct
from tandem.kernels.library import kernel_row_bytes
from tandem.models.moe import ExpertLinear, Experts
from tandem.models.quant.linear import QuantExpertLinear

_DENSE_TYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # ggml type ids


def _stacked(proj) -> tuple[torch.Tensor, int] | None:
    """(the stacked weight tensor, its ggml type) of one projection, or None where the kernel
    cannot read it as it is stored."""
    if isinstance(proj, QuantExpertLinear):
        w, t = proj.qweight, proj.qtype
    elif isinstance(proj, ExpertLinear) and proj.weight.dtype in _DENSE_TYPE:
        w, t = proj.weight.detach(), _DENSE_TYPE[proj.weight.dtype]
    else:
        return None
    try:
        kernel_row_bytes(t, proj.in_features)
    except native.NativeError:
        return None
    if w.device.type != "cpu" or not w.is_contiguous() or w.is_meta:
        return None
    return w, t


class FastExperts(Experts):
    native = False  # set by install_expert_kernels

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        parts = [_stacked(p) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        if (
            not self.native
            or any(p is None for p in parts)
            or not native.available()
            or x.dtype not in native.DTYPE_CODES
            or x.device.type != "cpu"
            or x.dim() != 2
            or x.shape[0] == 0
        ):
            return super().forward(x, weights, ids)
        (g, gt), (u, ut), (d, dt_) = parts
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        w = weights.to(x.dtype).float().contiguous()  # the reference multiplies in x's dtype
        y = torch.empty_like(x)
        M, D = x.shape
        act, keep = self._act()
        rc = native.library().tandem_moe_experts_act(
            x.data_ptr(), M, D, self.width, ids.data_ptr(), w.data_ptr(), ids.shape[1],
            self.first, self.count, g.data_ptr(), u.data_ptr(), d.data_ptr(), gt, ut, dt_,
            None if act is None else ctypes.addressof(act), y.data_ptr(),
            native.DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        del keep
        if rc != 0:
            raise native.NativeError("the native MoE experts refused their arguments")
        return y

    def _act(self) -> tuple[TqMoeAct | None, list]:
        """gpt-oss's activation and biases as csrc's tq_moe_act (None: SwiGLU, no biases), and
        the float32 bias tensors it points to (kept alive through the call)."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if self.activation == "swiglu" and all(p.bias is None for p in projs):
            return None, []
        keep = [None if p.bias is None else p.bias.detach().float().contiguous() for p in projs]
        ptrs = [None if b is None else b.data_ptr() for b in keep]
        kind = 1 if self.activation == "swiglu_clamped" else 0
        return TqMoeAct(*ptrs, kind, self.alpha, self.limit), keep


def install_expert_kernels(model: torch.nn.Module) -> int:
    """Puts every (fast) `Experts` of `model` on the native call; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, FastExperts):
            m.native = True
            n += 1
    return n
