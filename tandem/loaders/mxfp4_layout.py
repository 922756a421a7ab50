"""OpenAI's MXFP4 checkpoint layout <-> ggml's MXFP4 blocks, byte for byte (no torch, no floats).

gpt-oss's safetensors store a stacked expert weight W (E, rows, cols) (rows: the output
features, cols: the contraction, each row `cols / 32` blocks of 32) as two tensors:

    <proj>_blocks  uint8 (E, rows, cols / 32, 16)  two E2M1 codes a byte: byte k of block g holds
                                                    element 32 g + 2 k in its low nibble and
                                                    32 g + 2 k + 1 in its high one
    <proj>_scales  uint8 (E, rows, cols / 32)       block g's E8M0 exponent e: x = v(q) * 2^(e - 127),
                                                    v the OCP values 0 .5 1 1.5 2 3 4 6, sign bit 3

ggml's MXFP4 block (`models.quant.blocks`) is 17 bytes: e, then qs[16] with element j in the low
nibble of qs[j] and element j + 16 in its high one; x = kv(q) * 2^(e - 128), kv the same values
doubled. So the exponent byte carries over unchanged and only the nibbles move: with a block's
codes in element order, codes = (lo(b_0), hi(b_0), lo(b_1), hi(b_1), ..., lo(b_15), hi(b_15)),

    qs[j] = codes[j] | codes[j + 16] << 4        j = 0 .. 15

A row of W is then `cols / 32` such blocks, `row_bytes = cols / 32 * 17`: the (E, rows, row_bytes)
blocks `QuantExpertLinear` holds. llama.cpp's converter (`GptOssModel.repack_mxfp4`) does the same
repacking. Both directions act on any leading shape and are exact inverses.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # elements per block
PACKED = 16  # bytes of codes per block


def ggml_from_openai(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 (..., G, 16) and scales uint8 (..., G) -> ggml MXFP4 bytes (..., G * 17)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1:] != (PACKED,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: want (..., G, 16) and (..., G)"
        )
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    qs = codes[..., :PACKED] | (codes[..., PACKED:] << 4)  # (..., G, 16)
    out = np.concatenate((scales[..., None], qs), axis=-1)  # (..., G, 17)
    return out.reshape(*scales.shape[:-1], -1)


def openai_from_ggml(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 bytes (..., G * 17) -> (blocks uint8 (..., G, 16), scales uint8 (..., G))."""
    q = np.asarray(q, np.uint8)
    if q.shape[-1] % (PACKED + 1):
        raise ValueError(f"MXFP4 rows of {q.shape[-1]} bytes are not whole 17-byte blocks")
    b = q.reshape(*q.shape[:-1], -1, PACKED + 1)  # (..., G, 17)
    scales, qs = b[..., 0], b[..., 1:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # (..., G, 32) in element order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)
