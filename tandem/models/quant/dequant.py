"""Torch dequantization of GGUF blocks: `dequantize(blocks, type_id)` maps a uint8 tensor
`(..., row_bytes)` of whole blocks of ggml type `type_id` to float32 `(..., cols)`.

Vectorized over every block at once (no Python loop over blocks), on whatever device the blocks
live. Equal to `gguf.quants.dequantize` bit for bit: every scale is widened float16 -> float32
exactly, and each value is formed by the same float32 operations in the same order as gguf-py
(each product and sum rounded once, never fused into an FMA):

    Q8_0  q * d                     Q4_0  d * (q - 8)          Q5_0  d * (q - 16)
    Q4_1  (d * q) + m               Q5_1  (d * q) + m
    Q4_K  (d * sc_j) * q - (dmin * m_j)                        (Q5_K likewise, 5-bit q)
    Q6_K  (d * scale_j) * (q - 32)
    MXFP4 d * kv[q], d = 2^(e - 128) built from its bits (ggml's GGML_E8M0_TO_FP32_HALF: e < 2
          the subnormal 0x00200000 << e, else (e - 1) << 23), kv the doubled E2M1 values
    F32 as stored, F16 / BF16 widened exactly.

Field offsets come from the block-layout table (`blocks.LAYOUTS`), never from constants here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.models.quant.blocks import MXFP4_VALUES, BlockLayout, layout

_ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}


class BlockShapeError(ValueError):
    """A block tensor that is not uint8, or whose last dim is not a whole number of blocks."""


def _fields(t: BlockLayout, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks (N, block_bytes) uint8 -> each field of the layout as its own (N, n) tensor in
    its element type (f16 scales widened to float32, exactly)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, kind, count in t.fields:
        n = _ELEM_BYTES[kind] * count
        raw = blocks[:, offset : offset + n]
        offset += n
        if kind == "u8":
            out[name] = raw
        elif kind == "i8":
            out[name] = raw.view(torch.int8)
        elif kind == "f16":
            out[name] = raw.contiguous().view(torch.float16).float()
        elif kind == "bf16":
            out[name] = raw.contiguous().view(torch.bfloat16).float()
        else:
            out[name] = raw.contiguous().view(torch.float32)
    return out


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """qs (N, groups*width) uint8 -> (N, groups, 2, width): each group's low nibbles, then its
    high nibbles (ggml's order: element i of a group is the low half of byte i, element
    width + i its high half)."""
    q = qs.reshape(qs.shape[0], groups, 1, width)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


def _bits(qh: torch.Tensor, groups: int, width: int, shifts: tuple[int, ...], mask: int):
    """qh (N, groups*width) uint8 -> (N, groups, len(shifts), width): bit field `mask` of each
    byte at each shift (the high bits of the quants, in ggml's order)."""
    q = qh.reshape(qh.shape[0], groups, 1, width)
    return torch.cat([(q >> s) & mask for s in shifts], dim=2)


def _f32(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["x"]


def _f16(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["x"]


def _q8_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["qs"].float() * f["d"]


def _q4(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _nibbles(f["qs"], 1, 16).reshape(-1, 32)  # (N, 32) in 0..15


def _q5(f: dict[str, torch.Tensor]) -> torch.Tensor:
    high = _bits(f["qh"], 1, 4, tuple(range(8)), 1)  # (N, 1, 8, 4): bit s of byte b
    high = high.transpose(2, 3).reshape(-1, 32)  # element 8b + s: bit 8b+s of the LE uint32
    return _q4(f) | (high << 4)  # (N, 32) in 0..31


def _q4_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["d"] * (_q4(f).to(torch.int16) - 8).float()


def _q4_1(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return (f["d"] * _q4(f).float()) + f["m"]


def _q5_0(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["d"] * (_q5(f).to(torch.int16) - 16).float()


def _q5_1(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return (f["d"] * _q5(f).float()) + f["m"]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 2^(e - 128), exactly (ggml's GGML_E8M0_TO_FP32_HALF):
    the bits 0x00200000 << e for e < 2 (subnormals), (e - 1) << 23 otherwise."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(f: dict[str, torch.Tensor]) -> torch.Tensor:
    kv = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=f["qs"].device)
    return e8m0_half(f["e"]) * kv[_q4(f).long()]


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K superblock -> 8 six-bit scales and 8 six-bit mins
    (bytes 0-3: scale low 6 bits | 2 high bits of scales 4-7; 4-7: the same for mins; 8-11:
    low nibbles of scales 4-7 and mins 4-7)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn  # (N, 8) each


def _k_affine(f: dict[str, torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales(f["scales"])
    d = (f["d"] * sc.float())[:, :, None]  # (N, 8, 1)
    dm = (f["dmin"] * mn.float())[:, :, None]
    return (d * q.float() - dm).reshape(-1, 256)


def _q4_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _k_affine(f, _nibbles(f["qs"], 4, 32).reshape(-1, 8, 32))


def _q5_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    low = _nibbles(f["qs"], 4, 32).reshape(-1, 8, 32)
    high = _bits(f["qh"], 1, 32, tuple(range(8)), 1).reshape(-1, 8, 32)
    return _k_affine(f, low | (high << 4))


def _q6_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    d = (f["d"] * f["scales"].float())[:, :, None]  # (N, 16, 1)
    low = _nibbles(f["ql"], 2, 64).reshape(-1, 8, 32)
    high = _bits(f["qh"], 2, 32, (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(-1, 16, 16)
    return (d * q).reshape(-1, 256)


_DEQUANT: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "F32": _f32,
    "F16": _f16,
    "BF16": _f16,
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "MXFP4": _mxfp4,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize(blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    """blocks (..., row_bytes) uint8 of ggml type `type_id` -> float32 (..., cols), cols =
    row_bytes / block_bytes * block_size. Raises UnsupportedTypeError (from `blocks.layout`)
    for a type tandem does not read, BlockShapeError for a partial block."""
    t = layout(type_id)
    if blocks.dtype != torch.uint8 or blocks.dim() == 0:
        raise BlockShapeError(f"{t.name} blocks must be a uint8 tensor, got {blocks.dtype}")
    row_bytes = blocks.shape[-1]
    if row_bytes % t.block_bytes:
        raise BlockShapeError(
            f"{t.name}: a row of {row_bytes} bytes is not whole {t.block_bytes}-byte blocks"
        )
    lead = blocks.shape[:-1]
    cols = row_bytes // t.block_bytes * t.block_size
    flat = blocks.reshape(-1, t.block_bytes)  # (N blocks, block_bytes)
    values = _DEQUANT[t.name](_fields(t, flat))  # (N, block_size)
    return values.reshape(*lead, cols)
