"""Random GGUF blocks and the error bound of the native quantized GEMV (tandem/kernels/quant.py),
shared by the kernel tests and the AVX2 build check that runs them in a subprocess.

The bound, per output y = sum_i w_i x_i, where the kernel computes sum_i w_i x'_i exactly in
integers per block of 32 and then in float32:

- activation rounding: x'_i = dx_b q_i with q_i = nearest(x_i / dx_b), dx_b = fl(max_b |x| / 127),
  so |x_i - x'_i| <= dx_b / 2, plus the float32 rounding of x_i / dx_b before rounding to an
  integer (at most one ulp of a number <= 127.5, 2^-17 dx_b): |sum_i w_i (x_i - x'_i)| <=
  sum_b dx_b (1/2 + 2^-17) sum_{i in b} |w_i|;
- float32 rounding: w_i = a_i + o_i, a_i the block scale times the quant, o_i the block offset
  (Q4_0: -8 d; Q4_1: m; K-quants: -dmin m_j; Q6_K: -32 d sc_j; Q8_0, MXFP4: none). The kernel forms
  (s_b dx_b) * dot_b and o_b * (dx_b * sum_b q) in float32 (each product of two rounded factors:
  <= 3 ulps) and sums at most K/32 + 8 such terms per lane tree, so with A_i = |a_i| + |o_i| the
  error is <= (K/32 + 8) 2^-23 sum_i A_i (|x_i| + dx_b / 2), which also covers the reference's
  own float32 rounding of w_i (2^-24 |w_i|) and the dense types' plain float32 sum;
- the output's rounding to its dtype (bf16: 2^-8 |y|).

`magnitudes` computes A_i for any type from the block-layout table: quant bits all clear gives
o_i, all set gives a_max + o_i (Q8_0: qs = -128 gives -128 d), so A_i <= |w1 - w0| + |w0|.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import quants

from tandem.models.quant.blocks import BY_NAME

QUANT_NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "Q4_K", "Q5_K", "Q6_K")
DENSE_NAMES = ("F32", "F16", "BF16")
QUANT_FIELDS = ("qs", "qh", "ql")  # the layout fields holding quant bits
EXTREME_F16 = np.array([0.0, 65504.0, -65504.0, 6.1035e-05, 5.96e-08, -1.0, 1.0], np.float16)
# MXFP4 exponents at the extremes the bound is stated for: scales 2^-60 .. 2^64 (e - 128), whose
# products with any dx here stay normal float32 (a subnormal product rounds absolutely, not
# relatively) and whose outputs stay finite
EXTREME_E8M0 = np.array([68, 104, 113, 128, 144, 192], np.uint8)


def _field_slices(name: str) -> dict[str, tuple[int, int, str]]:
    """field -> (byte offset, byte length, kind) within one block."""
    size = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}
    out, off = {}, 0
    for field, kind, count in BY_NAME[name].fields:
        out[field] = (off, size[kind] * count, kind)
        off += size[kind] * count
    return out


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (rows, row_bytes) of random blocks of type `name`: every quant bit pattern, random
    sub-block scales, float16 scales/offsets random finite over many decades, with some blocks
    at extremes (0, +-65504, the smallest normal and subnormal float16); MXFP4 exponents
    likewise (scales 2^-13 .. 2^3, some at EXTREME_E8M0)."""
    t = BY_NAME[name]
    if name in DENSE_NAMES:
        w = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-3, 3, (rows, 1)))).astype(
            np.float32
        )
        if name == "F32":
            return w.view(np.uint8).reshape(rows, -1)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return np.ascontiguousarray(quants.quantize(w, quants.GGMLQuantizationType.BF16))
    nblk = rows * (cols // t.block_size)
    blk = rng.integers(0, 256, size=(nblk, t.block_bytes), dtype=np.uint8)
    for field, (off, n, kind) in _field_slices(name).items():
        if field == "e":  # E8M0 exponent: scale 2^(e - 128)
            e = rng.integers(115, 132, nblk).astype(np.uint8)
            pick = rng.random(nblk) < 0.1
            e[pick] = rng.choice(EXTREME_E8M0, int(pick.sum()))
            blk[:, off] = e
        if kind != "f16":
            continue
        v = (rng.standard_normal(nblk) * 10.0 ** rng.uniform(-3, 1, nblk)).astype(np.float16)
        pick = rng.random(nblk) < 0.1
        v[pick] = rng.choice(EXTREME_F16, int(pick.sum()))
        blk[:, off : off + n] = v.view(np.uint8).reshape(nblk, 2)
    return blk.reshape(rows, -1)


def dequant(blocks: np.ndarray, name: str) -> np.ndarray:
    """gguf-py's dequantization (the reference) as float64 (rows, cols)."""
    t = getattr(quants.GGMLQuantizationType, name)
    if name == "F16":  # gguf-py takes F16 as float16 elements
        return blocks.view(np.float16).astype(np.float64)
    return quants.dequantize(blocks, t).astype(np.float64)


def magnitudes(blocks: np.ndarray, name: str) -> np.ndarray:
    """A_i >= |a_i| + |o_i| per element (module docstring), float64 (rows, cols)."""
    if name in DENSE_NAMES:
        return np.abs(dequant(blocks, name))
    t = BY_NAME[name]
    shape = blocks.shape
    blk = blocks.reshape(-1, t.block_bytes)
    lo, hi = blk.copy(), blk.copy()
    for field, (off, n, _) in _field_slices(name).items():
        if field in QUANT_FIELDS:
            lo[:, off : off + n] = 0
            hi[:, off : off + n] = 0x80 if name == "Q8_0" else 0xFF
    w0, w1 = dequant(lo.reshape(shape), name), dequant(hi.reshape(shape), name)
    return np.abs(w1 - w0) + np.abs(w0)


def x_scales(x: np.ndarray) -> np.ndarray:
    """dx per element: the kernel's block scale fl(max |x| / 127) of its block of 32, float64."""
    m, k = x.shape
    amax = np.abs(x.astype(np.float32)).reshape(m, k // 32, 32).max(-1)
    dx = (amax / np.float32(127.0)).astype(np.float64)
    return np.repeat(dx, 32, axis=1)


def bound(
    x: np.ndarray, w: np.ndarray, mags: np.ndarray, quantized: bool, on_grid: bool = False
) -> np.ndarray:
    """The bound on |y - x.w| (m, n) for float64 x (m, k), w and mags (n, k); `on_grid`: x from
    `grid_x`, whose activation rounding is exactly zero."""
    k = x.shape[1]
    ax = np.abs(x)
    if not quantized:
        return (k / 8 + 16) * 2.0**-23 * (ax @ mags.T)
    dx = x_scales(x)
    act = 0.0 if on_grid else (dx * (0.5 + 2.0**-17)) @ np.abs(w).T
    flt = (k / 32 + 8) * 2.0**-23 * ((ax + dx / 2) @ mags.T)
    return act + flt


def grid_x(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """float32 x whose every block of 32 is already on its int8 grid: integers times a power of
    two c_b with one element +-127 c_b, so dx_b = c_b and the activation rounding is exactly 0."""
    q = rng.integers(-127, 128, size=(rows, cols // 32, 32)).astype(np.float32)
    q[..., 0] = np.where(rng.random((rows, cols // 32)) < 0.5, 127.0, -127.0)
    c = 2.0 ** rng.integers(-8, 4, size=(rows, cols // 32, 1)).astype(np.float32)
    return (q * c).reshape(rows, cols).astype(np.float32)


class RefQuantLinear(torch.nn.Module):
    """The QuantLinear contract (tandem/models/quant/linear.py): W (out, in) as GGUF blocks in
    the uint8 buffer `qweight` (out, row_bytes), forward = dequantize (gguf-py) to float32, cast to
    x's dtype, F.linear."""

    def __init__(self, qtype: int, in_features: int, out_features: int, qweight, bias=None):
        super().__init__()
        self.qtype, self.in_features, self.out_features = int(qtype), in_features, out_features
        self.register_buffer("qweight", qweight, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x):
        name = quants.GGMLQuantizationType(self.qtype).name
        w = torch.from_numpy(dequant(self.qweight.numpy(), name)).float().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def quantize_linear(lin: torch.nn.Linear, name: str) -> RefQuantLinear:
    """`lin` as GGUF blocks of type `name` (gguf-py's quantizer; K-quants tandem's)."""
    w = lin.weight.detach().float().numpy()
    t = getattr(quants.GGMLQuantizationType, name)
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        from tandem.models.quant.quantize import quantize

        blocks = quantize(w, int(t))
    elif name == "F32":
        blocks = w.view(np.uint8)
    elif name == "F16":
        blocks = w.astype(np.float16).view(np.uint8)
    else:
        blocks = quants.quantize(w, t)
    bias = None if lin.bias is None else lin.bias.detach().clone()
    return RefQuantLinear(int(t), lin.in_features, lin.out_features,
                          torch.from_numpy(np.ascontiguousarray(blocks)), bias)  # fmt: skip


def quantize_model(model: torch.nn.Module, pick) -> torch.nn.Module:
    """Every nn.Linear of `model` replaced by a RefQuantLinear of type pick(module name), in
    place (a tied head gets blocks of its own)."""
    for name in [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]:
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf,
                quantize_linear(model.get_submodule(name), pick(name)))  # fmt: skip
    return model
