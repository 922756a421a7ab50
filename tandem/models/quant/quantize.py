"""Float weights -> GGUF blocks: `quantize(values, type_id)` maps float32 `(..., cols)` to uint8
`(..., row_bytes)`.

F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 go through `gguf.quants.quantize` (llama.cpp's
reference quantizers, bit-exact with ggml). gguf-py cannot quantize the K-quants, so Q4_K, Q5_K
and Q6_K are packed here, and MXFP4 too (gguf-py's bytes, with its exponent clamped):

    MXFP4 llama.cpp's `quantize_row_mxfp4_ref` / gguf-py's MXFP4: per block of 32
          e = floor(log2(max|x|)) - 2 + 127 (float32 log2; 0 for an all-zero block), the OCP MX
          choice: the largest code 12 * 2^(e - 128) = 1.5 * 2^floor(log2 max|x|), so values
          past it (by up to a third of it) clip to it; each value the code whose
          kv * 2^(e - 128) is nearest in float32 (ties to the lower code). Where max|x| <
          2^-125 the formula goes below 0, which gguf-py wraps and llama.cpp leaves undefined
          (a float -> uint8 cast): e = 0 here, the finest scale; an infinite max gives 254.

    Q4_K / Q5_K  llama.cpp's `quantize_row_q{4,5}_K_ref`: per sub-block of 32 values the
          weighted min/scale search `make_qkx2_quants` (`kquant_search.search_scale_min`) gives a
          step s_j and an offset m_j >= 0; per superblock d = max s_j / 63, dmin = max m_j / 63
          (float16), 6-bit sc_j = round(s_j / d), m6_j = round(m_j / dmin);
          q = clip(round((x + dmin m6_j) / (d sc_j)), 0, 2^b - 1)
    Q6_K  round-to-nearest (not llama.cpp's `make_qx_quants` search): per 16 values
          scale_j = max|x| / 32 as int8 steps of d = max_j scale_j / 127;
          q = round(x / (d * sc_j)) + 32 in [0, 63]

The byte layout is the inverse of `dequant`'s (fields in `blocks.LAYOUTS` order).
"""

from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType

from tandem.models.quant.blocks import MXFP4_VALUES, layout
from tandem.models.quant.kquant_search import SEARCH, search_scale_min


def quantize(values: np.ndarray, type_id: int) -> np.ndarray:
    """values (..., cols) float -> uint8 blocks (..., row_bytes) of ggml type `type_id`."""
    t = layout(type_id)
    x = np.ascontiguousarray(values, dtype=np.float32)
    lead, cols = x.shape[:-1], x.shape[-1]
    row_bytes = t.row_bytes(cols)
    packer = _PACKERS.get(t.name)
    if packer is None:
        out = quants.quantize(x, GGMLQuantizationType(t.type_id))
        return np.ascontiguousarray(out).view(np.uint8).reshape(*lead, row_bytes)
    flat = x.reshape(-1, t.block_size)
    step = _CHUNK.get(t.name, 1 << 20) // t.block_size
    blocks = np.concatenate(  # in chunks: the temporaries are 16-40x the chunk
        [packer(flat[i : i + step]) for i in range(0, flat.shape[0], step)]
        or [np.empty((0, t.block_bytes), np.uint8)]
    )
    assert blocks.shape[1] == t.block_bytes
    return blocks.reshape(*lead, row_bytes)


_CHUNK = {"MXFP4": 1 << 16}  # values per packer call: else 1 Mi (4096 K-quant superblocks)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)  # (N, 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def _pack_nibbles(q: np.ndarray, groups: int, width: int) -> np.ndarray:
    """q (N, groups*2*width) in [0, 15] -> (N, groups*width) bytes: per group the first `width`
    values in the low nibbles, the next `width` in the high ones."""
    g = q.reshape(q.shape[0], groups, 2, width).astype(np.uint8)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(q.shape[0], -1)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per superblock -> the 12 packed bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    b0 = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    b1 = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    b2 = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=1)


def _k_affine(x: np.ndarray, bits: int):
    """x (N, 256) -> d, dmin (N,) float16-rounded, sc, m6 (N, 8), q (N, 256) in [0, 2^bits-1]."""
    nmax = 2**bits - 1
    sub = x.reshape(-1, 32)
    s, m, searched = search_scale_min(sub, nmax, *SEARCH[bits])  # (N*8,), (N*8,), (N*8, 32)
    s, m = s.reshape(-1, 8), m.reshape(-1, 8)
    smax, mmax = s.max(axis=1), m.max(axis=1)
    sc = np.clip(np.rint(_safe_div(63 * s, smax[:, None])), 0, 63)
    m6 = np.clip(np.rint(_safe_div(63 * m, mmax[:, None])), 0, 63)
    d = (smax / 63).astype(np.float16).astype(np.float32)
    dmin = (mmax / 63).astype(np.float16).astype(np.float32)
    step = (d[:, None] * sc).reshape(-1, 1)  # (N*8, 1)
    offset = (dmin[:, None] * m6).reshape(-1, 1)
    q = np.clip(np.rint(_safe_div(sub + offset, step)), 0, nmax)
    q = np.where(step == 0, searched, q)  # llama.cpp keeps the search's q where the step is 0
    return d, dmin, sc, m6, q.reshape(-1, 256).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m6, q = _k_affine(x, 4)
    qs = _pack_nibbles(q, 4, 32)  # (N, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k_scales(sc, m6), qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m6, q = _k_affine(x, 5)
    qs = _pack_nibbles(q & 0x0F, 4, 32)
    high = (q >> 4).reshape(-1, 8, 32)  # bit 4 of sub-block j's value i -> bit j of qh[i]
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([_f16(d), _f16(dmin), _k_scales(sc, m6), qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=2)  # (N, 16)
    scale = amax / 32
    d = (scale.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), -128, 127)
    step = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.round(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # (N, half, quarter, 32): value 128 h + 32 k + i
    low = q & 0x0F
    ql = np.concatenate(  # per half: quarters 0,1 in low nibbles of 64 bytes, 2,3 in high
        [low[:, h, :2].reshape(-1, 64) | (low[:, h, 2:].reshape(-1, 64) << 4) for h in range(2)],
        axis=1,
    )
    high = q >> 4  # 2 bits, quarter k at bit 2k of byte 32 h + i
    qh = np.concatenate(
        [sum(high[:, h, k] << (2 * k) for k in range(4)).astype(np.uint8) for h in range(2)],
        axis=1,
    )
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)


def _mxfp4(x: np.ndarray) -> np.ndarray:
    """x (N, 32) -> (N, 17): gguf-py's `MXFP4.quantize_blocks` step for step (the same float32
    operations, so the same bytes), the exponent clamped to [0, 254] (module docstring)."""
    amax = np.abs(x).max(axis=1, keepdims=True)  # (N, 1) float32
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(amax)) - 2 + 127
    e = np.where(amax > 0, np.clip(np.nan_to_num(e, nan=0.0), 0, 254), 0).astype(np.uint8)
    d = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32),
                 (e.astype(np.uint32) - 1) << 23).view(np.float32)  # fmt: skip
    kv = np.array(MXFP4_VALUES, dtype=np.float32)
    errs = np.abs(d[:, :, None] * kv - x[:, :, None])  # (N, 32, 16)
    q = np.argmin(errs, axis=-1)  # the first of equal errors: the lower code
    return np.concatenate([e, _pack_nibbles(q, 1, 16)], axis=1)


_PACKERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}
