"""`MoEBlock`: a sparse layer's feed-forward on the torch-free path, one native call
(csrc/moe.c `tandem_moe_block`: norm, router, softmax and top-k, then every chosen expert's tokens
through its stacked GGUF blocks as stored) per layer and step. The math is `models.moe.MoE`'s in
float32; experts not chosen by any token of the step are never read."""

from __future__ import annotations

import ctypes

import numpy as np

from tandem.kernels import library
from tandem.kernels.lean import ops
from tandem.kernels.lean.linear import LeanWeightError, Linear


class MoEBlock:
    """The router (a `Linear` of E rows, F32 as llama.cpp keeps it, or blocks) and the experts'
    three stacked block arrays (E, rows, row_bytes) of one sparse layer of `src`."""

    def __init__(self, src, layer: int, norm: np.ndarray) -> None:
        c = src.config
        spec = c.moe
        if spec.shared_intermediate_size:
            raise LeanWeightError("a shared expert (the torch path runs it)")
        p = f"model.layers.{layer}.mlp."
        self.D, self.E, self.k, self.W = (
            c.hidden_size,
            spec.num_experts,
            spec.top_k,
            spec.intermediate_size,
        )
        self.normalize = int(spec.norm_topk_prob)
        self.norm, self.eps = norm, c.rms_norm_eps
        router = p + "gate.weight"
        self.router = Linear(
            [(src.block_array(router), src.info(router).type_id)], self.D, None, router
        )
        self.arrays, self.types = [], []
        for name, cols in (("gate_proj", self.D), ("up_proj", self.D), ("down_proj", self.W)):
            full = p + f"experts.{name}.weight"
            blocks, t = src.block_array(full), src.info(full).type_id
            try:
                _, rb = library.kernel_row_bytes(t, cols)
            except library.NativeError as e:
                raise LeanWeightError(f"{full}: {e}") from None
            if blocks.ndim != 3 or blocks.shape[2] != rb or not blocks.flags.c_contiguous:
                raise LeanWeightError(f"{full}: expected contiguous (E, rows, {rb}) blocks")
            self.arrays.append(blocks)
            self.types.append(t)

    def __call__(self, x: np.ndarray, threads: int) -> np.ndarray:
        """x (N, D) the residual stream -> the block's output (N, D) (the caller adds it)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        g, u, d = self.arrays
        rc = library.library().tandem_moe_block(
            x.ctypes.data, x.shape[0], self.norm.ctypes.data, self.eps,
            ctypes.addressof(self.router.desc), self.E, self.k, self.normalize, self.D, self.W,
            0, self.E, g.ctypes.data, u.ctypes.data, d.ctypes.data, *self.types, out.ctypes.data,
            ops.F32, threads,
        )  # fmt: skip
        if rc != 0:
            raise ops.LeanKernelError("the native MoE block refused its arguments")
        return out

    def expert_bytes(self) -> int:
        """Bytes of one expert's three projections (what each chosen expert reads)."""
        return sum(a[0].nbytes for a in self.arrays)
