"""GGUF tensor bytes as float32 values in numpy, without torch: the dense types widened exactly,
the block-quantized ones dequantized by gguf-py (`gguf.quants.dequantize`, which the torch
dequantization in `dequant.py` equals bit for bit). For the small tensors and the rows one step
reads (norms, biases, rope factors, embedding rows), not for whole matrices."""

from __future__ import annotations

import numpy as np

from tandem.models.quant.blocks import BY_NAME, QUANTIZED

F32, F16, BF16 = (BY_NAME[n].type_id for n in ("F32", "F16", "BF16"))


def as_float32(rows: np.ndarray, type_id: int) -> np.ndarray:
    """uint8 rows (R, row_bytes) of ggml type `type_id` -> float32 (R, cols): a view for F32, a new
    array otherwise. The caller has checked the type is one tandem reads (blocks.layout)."""
    if type_id in QUANTIZED:
        from gguf.quants import dequantize

        return np.asarray(dequantize(rows, type_id), dtype=np.float32)
    if type_id == F32:
        return rows.view(np.float32)
    if type_id == F16:
        return rows.view(np.float16).astype(np.float32)
    if type_id == BF16:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"ggml type {type_id} is not one tandem reads")
