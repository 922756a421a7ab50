"""`DeltaNetMixer`: a Qwen3.5 hybrid's Gated DeltaNet layer on the torch-free path, over the GGUF
blocks as stored (the math: `tandem.models.deltanet`, csrc/deltanet.c).

The four input projections are one `Linear` over their parts, rows stacked as
P = [in_proj_qkv (C) | in_proj_z (Hv dv) | in_proj_b (Hv) | in_proj_a (Hv)], C = 2 Hk dk + Hv dv;
out_proj is another. A step of one row and one token is one native call for the whole mixer
(`step`: input norm, P, the conv / delta rule / gated norm, out_proj); a prefill row of T tokens
is P for all T at once (the projection kernels' multi-row path), then the recurrent form over the
T tokens in one call (`mix`), then out_proj for all T. There is no chunked form here: a prefill
reads the state once per token.

Each sequence's state is its slot's conv window (C, K - 1) and matrices (Hv, dk, dv), float32,
held by the model (`LeanModel.conv`, `LeanModel.ssm`); a row starting at position 0 starts from
zeros. A stored A (a GGUF: `DeltaNetSpec.a_log` False) is used as is; an A_log becomes
A = -exp(A_log) once, in float32.
"""

from __future__ import annotations

import ctypes

import numpy as np

from tandem.config import ModelConfig
from tandem.kernels import library
from tandem.kernels.lean import ops
from tandem.kernels.lean.linear import Linear

_IN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class DeltaNetMixer:
    """Layer `i`'s DeltaNet weights from `src` (a `lean.model.WeightSource`), the layer's input
    norm `in_norm` (D,) as the model's RMSNorm multiplies it (module docstring)."""

    def __init__(self, src, i: int, config: ModelConfig, in_norm: np.ndarray) -> None:
        s = config.deltanet
        p = f"model.layers.{i}.linear_attn."
        self.Hk, self.Hv = s.num_key_heads, s.num_value_heads
        self.dk, self.dv, self.K = s.key_head_dim, s.value_head_dim, s.conv_kernel
        self.C = s.conv_dim
        self.tiled = bool(s.v_tiled)
        self.D, self.eps, self.in_norm = config.hidden_size, config.rms_norm_eps, in_norm
        self.P = self.C + self.Hv * self.dv + 2 * self.Hv  # in_proj's rows (module docstring)
        parts = [
            (
                src.block_array(p + n + ".weight", as_stored=True),
                src.info(p + n + ".weight").type_id,
            )
            for n in _IN
        ]
        self.inp = Linear(parts, self.D, None, p + "in_proj")
        self.out = Linear(
            [(src.block_array(p + "out_proj.weight", as_stored=True),
              src.info(p + "out_proj.weight").type_id)],
            self.Hv * self.dv, None, p + "out_proj",
        )  # fmt: skip
        self.conv_w = _f32(src.values_array(p + "conv1d.weight").reshape(self.C, self.K))
        a = src.values_array(p + "A_log").astype(np.float32)
        self.A = _f32(-np.exp(a) if s.a_log else a)  # (Hv,), A < 0
        self.dt_bias = _f32(src.values_array(p + "dt_bias"))
        self.norm_w = _f32(src.values_array(p + "norm.weight"))  # (dv,) plain w
        if self.inp.out_features != self.P or self.norm_w.shape != (self.dv,):
            raise ops.LeanKernelError(f"{p}: projections of {self.inp.out_features} rows")

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv window (C, K - 1), matrices (Hv, dk, dv)) of one sequence."""
        return (self.C, self.K - 1), (self.Hv, self.dk, self.dv)

    def mix(self, proj: np.ndarray, window: np.ndarray, state: np.ndarray, th: int) -> np.ndarray:
        """One sequence's T tokens: proj (T, P) -> y (T, Hv dv), the gated norm's output;
        window (C, K - 1) and state (Hv, dk, dv) updated in place (csrc tandem_deltanet_mix)."""
        self._check_state(window, state)
        if proj.dtype != np.float32 or proj.ndim != 2 or proj.shape[1] != self.P:
            raise ops.LeanKernelError(f"deltanet mix: proj {proj.dtype} {proj.shape}")
        proj = np.ascontiguousarray(proj)
        y = np.empty((proj.shape[0], self.Hv * self.dv), np.float32)
        rc = library.library().tandem_deltanet_mix(
            proj.ctypes.data, self.P, proj.shape[0], self.conv_w.ctypes.data, self.A.ctypes.data,
            self.dt_bias.ctypes.data, self.norm_w.ctypes.data, self.eps, window.ctypes.data,
            state.ctypes.data, y.ctypes.data, self.Hk, self.Hv, self.dk, self.dv, self.K,
            int(self.tiled), th,
        )  # fmt: skip
        ops._check(rc, "deltanet mix")
        return y

    def step(self, h: np.ndarray, window: np.ndarray, state: np.ndarray, th: int) -> np.ndarray:
        """One decode token: the residual row h (1, D) -> the mixer's output (1, D) in one call
        (csrc tandem_deltanet_step); window and state updated in place."""
        self._check_state(window, state)
        if h.dtype != np.float32 or h.shape != (1, self.D) or not h.flags.c_contiguous:
            raise ops.LeanKernelError(f"deltanet step: h {h.dtype} {h.shape}")
        out = np.empty_like(h)
        rc = library.library().tandem_deltanet_step(
            h.ctypes.data, self.in_norm.ctypes.data, self.eps, ctypes.addressof(self.inp.desc),
            ctypes.addressof(self.out.desc), self.conv_w.ctypes.data, self.A.ctypes.data,
            self.dt_bias.ctypes.data, self.norm_w.ctypes.data, self.eps, window.ctypes.data,
            state.ctypes.data, out.ctypes.data, self.D, self.Hk, self.Hv, self.dk, self.dv,
            self.K, int(self.tiled), th,
        )  # fmt: skip
        ops._check(rc, "deltanet step")
        return out

    def prefill(
        self,
        xn: np.ndarray,
        bounds: np.ndarray,
        states: list[tuple[np.ndarray, np.ndarray]],
        th: int,
    ) -> np.ndarray:
        """The normed rows of a step xn (N, D), row b's tokens xn[bounds[b]:bounds[b + 1]] ->
        the mixer's output (N, D): P for all N, each row's tokens through its own (window,
        state) in order, out_proj for all N."""
        proj = self.inp(xn, th)  # (N, P)
        y = np.empty((xn.shape[0], self.Hv * self.dv), np.float32)
        for (window, state), r0, r1 in zip(states, bounds[:-1], bounds[1:]):
            y[r0:r1] = self.mix(proj[r0:r1], window, state, th)
        return self.out(y, th)

    def _check_state(self, window: np.ndarray, state: np.ndarray) -> None:
        (wshape, sshape) = self.state_shapes()
        for a, shape in ((window, wshape), (state, sshape)):
            if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
                raise ops.LeanKernelError(f"deltanet state {a.dtype} {a.shape}, want {shape}")
