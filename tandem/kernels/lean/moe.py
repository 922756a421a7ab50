"""`MoEBlock`: a sparse layer's feed-forward on the torch-free path, one native call
(csrc/moe.c `tandem_moe_layer`: norm, router, the route, then every chosen expert's tokens
through its stacked GGUF blocks as stored, and a shared expert where the layer has one) per layer
and step, the call the one-call decode (csrc/decode_model.c) makes for the layer. The math is `models.moe.MoE`'s in
float32; experts not chosen by any token of the step are never read.

Both routes of `MoESpec.router`: softmax over all E logits then the top k (Qwen3-MoE, Mixtral;
renormalised with `norm_topk_prob`), or gpt-oss's top k of the (biased) logits then softmax over
those k. gpt-oss's experts add their biases after each projection and take the clamped SwiGLU
(`models.moe.clamped_swiglu`), csrc's `tq_moe_act`.

A shared expert (Qwen2-MoE, `SharedExpert`) adds sigmoid(h . w_g) * down_s(silu(gate_s h) * up_s h)
for the normed h, as a dense layer's MLP runs (gate/up in one GEMV, SwiGLU, down) beside the gate's
one-row GEMV, in the same native call (csrc/decode_layers.h `tq_moe_shared`)."""

from __future__ import annotations

import ctypes

import numpy as np

from tandem.kernels import library
from tandem.kernels.cstructs import TqMoeAct, TqMoeLayer, TqMoeShared
from tandem.kernels.lean import ops
from tandem.kernels.lean.linear import LeanWeightError, Linear

ROUTES = {"softmax_topk": 0, "topk_softmax": 1}  # csrc tandem_moe_route_kind's `kind`
ACTIVATIONS = {"swiglu": 0, "swiglu_clamped": 1}  # csrc tq_moe_act's `kind`


def _f32(src, name: str) -> np.ndarray:
    return np.ascontiguousarray(src.values_array(name), dtype=np.float32)


class MoEBlock:
    """The router (a `Linear` of E rows, F32 as llama.cpp keeps it, or blocks) and the experts'
    three stacked block arrays (E, rows, row_bytes) of one sparse layer of `src`."""

    def __init__(self, src, layer: int, norm: np.ndarray) -> None:
        c = src.config
        spec = c.moe
        p = f"model.layers.{layer}.mlp."
        self.D, self.E, self.k, self.W = (
            c.hidden_size,
            spec.num_experts,
            spec.top_k,
            spec.intermediate_size,
        )
        self.normalize = int(spec.norm_topk_prob)
        self.route = ROUTES[spec.router]
        self.norm, self.eps = norm, c.rms_norm_eps
        router = p + "gate.weight"
        bias = _f32(src, p + "gate.bias") if spec.router_bias else None
        self.router = Linear(
            [(src.block_array(router), src.info(router).type_id)], self.D, bias, router
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
        # gpt-oss: biases (E, W), (E, W), (E, D) and the clamped SwiGLU; None: SwiGLU, no biases
        self.biases: list[np.ndarray | None] = [None, None, None]
        self.act = None
        if spec.expert_bias:
            self.biases = [
                _f32(src, p + f"experts.{n}.bias") for n in ("gate_proj", "up_proj", "down_proj")
            ]
            for b, rows in zip(self.biases, (self.W, self.W, self.D)):
                if b.shape != (self.E, rows):
                    raise LeanWeightError(f"{p}experts: a bias {b.shape}, not ({self.E}, {rows})")
        self.shared = None
        if spec.shared_intermediate_size:
            self.shared = SharedExpert(src, p, self.D, spec.shared_intermediate_size)
        if spec.expert_bias or spec.activation != "swiglu":
            self.act = TqMoeAct(
                *(None if b is None else b.ctypes.data for b in self.biases),
                ACTIVATIONS[spec.activation], spec.swiglu_alpha, spec.swiglu_limit,
            )  # fmt: skip
        g, u, d = self.arrays
        # this block as a layer of the one-call decode takes it (csrc/decode_model.c)
        self.desc = TqMoeLayer(
            ctypes.addressof(self.router.desc), self.E, self.k, self.route, self.normalize,
            self.W, g.ctypes.data, u.ctypes.data, d.ctypes.data, *self.types,
            None if self.act is None else ctypes.addressof(self.act),
            None if self.shared is None else ctypes.addressof(self.shared.desc),
        )  # fmt: skip

    def __call__(self, x: np.ndarray, threads: int) -> np.ndarray:
        """x (N, D) the residual stream -> the block's output (N, D) (the caller adds it)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        rc = library.library().tandem_moe_layer(
            ctypes.addressof(self.desc), x.ctypes.data, x.shape[0], self.norm.ctypes.data,
            self.eps, self.D, out.ctypes.data, ops.F32, threads,
        )  # fmt: skip
        if rc != 0:
            raise ops.LeanKernelError("the native MoE block refused its arguments")
        return out

    def expert_bytes(self) -> int:
        """Bytes of one expert's three projections (what each chosen expert reads), biases
        included."""
        return sum(a[0].nbytes for a in self.arrays) + sum(
            b[0].nbytes for b in self.biases if b is not None
        )


class SharedExpert:
    """A sparse layer's sigmoid-gated shared expert (module docstring) over the file's blocks:
    gate/up as one two-part `Linear`, down, and the gate's one row (F32 as llama.cpp keeps it);
    `desc` the `tq_moe_shared` the MoE block's native call runs."""

    def __init__(self, src, p: str, D: int, width: int) -> None:
        def part(name: str) -> tuple[np.ndarray, int]:
            blocks = src.block_array(p + name)  # (rows, row_bytes); a vector's one row
            return blocks.reshape(-1, blocks.shape[-1]), src.info(p + name).type_id

        s = "shared_expert."
        self.gate_up = Linear(
            [part(s + "gate_proj.weight"), part(s + "up_proj.weight")], D, None, p + s + "gate_up"
        )
        self.down = Linear([part(s + "down_proj.weight")], width, None, p + s + "down_proj")
        # (D,) in llama.cpp's files: one row
        self.gate = Linear([part("shared_expert_gate.weight")], D, None, p + "shared_expert_gate")
        rows = (self.gate_up.out_features, self.down.out_features, self.gate.out_features)
        if rows != (2 * width, D, 1):
            raise LeanWeightError(f"{p}shared_expert: rows {rows}, not {(2 * width, D, 1)}")
        self.desc = TqMoeShared(
            ctypes.addressof(self.gate_up.desc), ctypes.addressof(self.down.desc),
            ctypes.addressof(self.gate.desc), width,
        )  # fmt: skip
