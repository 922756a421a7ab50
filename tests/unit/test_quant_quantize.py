"""The float -> GGUF-block quantizers behind `tandem quantize` and `--quantize`
(`models.quant.quantize`, `models.quant.kquant_search`): Q8_0 and Q4_0 are gguf-py's own bytes;
each type's dequantized values are within its stated bound of the originals; Q4_K is llama.cpp's
min/scale search (never worse than the plain fit it starts from, and as accurate as Q4_1).

Stated bounds, per block of 32 with d the float32 scale and d' the float16 one stored:
    Q8_0  d = max|x| / 127, q = round(x / d) in [-127, 127]:  |err| <= d / 2 + 127 |d - d'|
    Q4_0  d = x_amax / -8, q in [-8, 7] (the extreme opposite x_amax may clip from 8 to 7):
          |err| <= |d| + 8 |d - d'|
    Q4_K  per sub-block j, step s_j = d sc_j and offset o_j = dmin m6_j as stored: each value
          is the nearest point of its grid {s_j q - o_j : q in [0, 15]} (|err| <= s_j / 2 inside
          the grid's span, the nearest end outside it)
    MXFP4 gguf-py's bytes where its exponent is defined (max|x| >= 2^-125), e = 0 below; each
          value the nearest point of {kv 2^(e - 128)}, whose largest, 12 * 2^(e - 128), is
          1.5 * 2^floor(log2 max|x|), 3/4 to 3/2 of max|x| (values past it clip to it)
"""

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from tandem.models.quant.blocks import BY_NAME
from tandem.models.quant.dequant import dequantize
from tandem.models.quant.kquant_search import SEARCH, search_scale_min
from tandem.models.quant.quantize import _k_affine, quantize


def rows(seed: int, n: int = 16, cols: int = 512) -> np.ndarray:
    """Gaussian rows with a few hostile ones: all zero, constant, one outlier, all negative."""
    x = np.random.default_rng(seed).standard_normal((n, cols)).astype(np.float32)
    x[1] = 0.0
    x[2] = 0.25
    x[3, 7] = 40.0
    x[4] = -np.abs(x[4])
    x[5] *= 1e-3
    return x


def deq(blocks: np.ndarray, name: str) -> np.ndarray:
    return dequantize(torch.from_numpy(blocks), BY_NAME[name].type_id).numpy()


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_q8_0_and_q4_0_blocks_are_gguf_py_quantize_bit_for_bit(name):
    x = rows(1)
    ours = quantize(x, BY_NAME[name].type_id)
    theirs = quants.quantize(x, GGMLQuantizationType[name]).view(np.uint8)
    assert np.array_equal(ours, theirs.reshape(ours.shape))


def test_q8_0_and_q4_0_values_are_within_their_stated_bounds():
    x = rows(2)
    blk = x.reshape(-1, 32)
    amax = np.abs(blk).max(axis=1, keepdims=True)
    for name, d, qmax, half in (("Q8_0", amax / 127, 127, 0.5), ("Q4_0", amax / 8, 8, 1.0)):
        f16 = np.abs(d.astype(np.float16).astype(np.float32) - d)  # the stored scale's rounding
        err = np.abs(deq(quantize(x, BY_NAME[name].type_id), name).reshape(-1, 32) - blk)
        assert (err <= half * d + qmax * f16 + 1e-7 * (1 + amax)).all(), name


def test_q4_k_values_are_the_nearest_point_of_their_sub_blocks_stored_grid():
    x = rows(3)
    d, dmin, sc, m6, q = _k_affine(x.reshape(-1, 256), 4)
    step = (d[:, None] * sc).reshape(-1, 1)  # (sub-blocks, 1)
    offset = (dmin[:, None] * m6).reshape(-1, 1)
    got = deq(quantize(x, BY_NAME["Q4_K"].type_id), "Q4_K").reshape(-1, 32)
    # the packed bytes hold exactly these fields
    assert np.allclose(got, step * q.reshape(-1, 32) - offset, rtol=0, atol=1e-6)
    sub = x.reshape(-1, 32)
    grid = step * np.arange(16, dtype=np.float32) - offset  # (sub-blocks, 16)
    nearest = np.abs(sub[:, :, None] - grid[:, None, :]).min(axis=2)
    assert (np.abs(got - sub) <= nearest + 1e-6 * (1 + np.abs(sub))).all()


@pytest.mark.parametrize("bits", [4, 5])
def test_the_k_quant_search_never_does_worse_than_the_plain_fit_it_starts_from(bits):
    sub = rows(4, n=64).reshape(-1, 32)
    nmax = 2**bits - 1
    s, m, q = search_scale_min(sub, nmax, *SEARCH[bits])
    w = np.sqrt((sub * sub).mean(axis=1, keepdims=True)) + np.abs(sub)
    lo = np.minimum(sub.min(axis=1, keepdims=True), 0)
    span = sub.max(axis=1, keepdims=True) - lo
    plain_s = np.where(span == 0, 0, span / nmax)
    plain_q = np.clip(
        np.rint(np.where(span == 0, 0, (sub - lo) / np.where(span == 0, 1, span) * nmax)), 0, nmax
    )
    plain = (w * (plain_s * plain_q + lo - sub) ** 2).sum(axis=1)
    found = (w * (s[:, None] * q - m[:, None] - sub) ** 2).sum(axis=1)
    assert (found <= plain * (1 + 1e-5) + 1e-12).all()
    assert (found < plain * 0.99).mean() > 0.5  # and it does find better fits


def test_q4_k_is_as_accurate_as_q4_1_on_gaussian_weights():
    x = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)
    rms = {}
    for name in ("Q4_K", "Q4_1"):
        err = deq(quantize(x, BY_NAME[name].type_id), name).reshape(x.shape) - x
        rms[name] = float(np.sqrt((err**2).mean()))
    assert rms["Q4_K"] <= rms["Q4_1"], rms


def test_mxfp4_blocks_are_gguf_py_quantize_bit_for_bit_over_a_wide_range():
    x = rows(6, n=64)
    x[6:] *= (2.0 ** np.random.default_rng(7).integers(-100, 100, (58, 1))).astype(np.float32)
    x[6, :32] = 1.5  # max|x| on the grid's top, and a power of two
    x[7, :32] = np.float32(2.0) - np.float32(2.0**-23)  # just below a power of two
    ours = quantize(x, BY_NAME["MXFP4"].type_id)
    theirs = quants.quantize(x, GGMLQuantizationType.MXFP4).view(np.uint8)
    assert np.array_equal(ours, theirs.reshape(ours.shape))


def test_mxfp4_values_are_the_nearest_point_of_the_blocks_grid_and_tiny_blocks_clamp_to_e_0():
    x = rows(8)
    x[8] *= 2.0**-130  # max|x| < 2^-125: gguf-py's exponent would wrap below 0
    x[9, :32] = np.float32(2.0**-149)  # the smallest subnormal
    blocks = quantize(x, BY_NAME["MXFP4"].type_id).reshape(-1, 17)
    e = blocks[:, 0].astype(np.float64)
    sub = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(sub).max(axis=1)
    tiny = amax < 2.0**-125
    assert (e[tiny] == 0).all() and (e[amax == 0] == 0).all()
    live = ~tiny & (amax > 0)
    assert (e[live] == np.floor(np.log2(amax[live])) + 125).all()
    grid = np.array([0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12], np.float64)
    step = 2.0 ** (e - 128)
    got = deq(blocks.reshape(x.shape[0], -1), "MXFP4").reshape(-1, 32).astype(np.float64)
    nearest = np.abs(sub[:, :, None] - step[:, None, None] * grid).min(axis=2)
    assert (np.abs(got - sub) <= nearest * (1 + 2.0**-20)).all()
    assert (np.abs(got).max(axis=1)[live] >= 0.75 * amax[live]).all()  # the clip, at most 1/4
