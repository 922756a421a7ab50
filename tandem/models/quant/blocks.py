"""The GGUF/ggml tensor types tandem reads, as one table: elements per block, bytes per block and
the fields of one block in storage order. Everything that needs a layout (the loader's shape
checks, the TP plan's block boundaries, the dequantizers, the kernels' row strides) reads it here.

A weight W (rows, cols) in type t is stored row-major, each row `cols / block_size` whole blocks:
`row_bytes(t, cols) = cols / block_size * block_bytes`. A TP shard that splits rows keeps whole
blocks for free; one that splits columns (the contraction of a row-parallel layer) must cut at a
multiple of `block_size` elements.

Field notation: `d`, `m`, `dmin` are float16 scales/offsets; `e` an E8M0 exponent byte (MXFP4);
`qs` packed low bits of the quants, `qh` their high bits; `scales` packed 6-bit sub-block
scales/mins (K-quants, 8 sub-blocks of 32) or int8 sub-block scales (Q6_K, 16 sub-blocks of 16).
Values:
  Q4_0  x = d * (q4 - 8)              Q4_1  x = d * q4 + m
  Q5_0  x = d * (q5 - 16)             Q5_1  x = d * q5 + m
  Q8_0  x = d * q8 (int8)
  MXFP4 x = 2^(e - 128) * kv[q4],  kv = 0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12
        (OCP MX E2M1 values doubled, so the scale is half the E8M0 one: finite for every e,
        e = 0, 1 the subnormals 2^-128, 2^-127 and e = 255 2^127, not NaN, as ggml has it;
        the products overflow to inf for e >= 253 with the larger codes)
  Q4_K  x = d * sc_j * q4 - dmin * m_j           (sub-block j of 32)
  Q5_K  x = d * sc_j * q5 - dmin * m_j           (sub-block j of 32)
  Q6_K  x = d * scales_j * (q6 - 32)             (sub-block j of 16)
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGMLQuantizationType


class UnsupportedTypeError(ValueError):
    """A tensor type id tandem does not read (or that does not exist)."""


@dataclass(frozen=True)
class BlockLayout:
    """One ggml tensor type: `block_size` elements stored in `block_bytes` bytes as `fields`
    ((name, element type, count) in storage order)."""

    name: str
    type_id: int
    block_size: int
    block_bytes: int
    fields: tuple[tuple[str, str, int], ...]

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` elements; `cols` must be whole blocks."""
        if cols % self.block_size:
            raise ValueError(f"{self.name}: {cols} columns is not a multiple of {self.block_size}")
        return cols // self.block_size * self.block_bytes


def _layout(name: str, block_size: int, *fields: tuple[str, str, int]) -> BlockLayout:
    size = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}
    nbytes = sum(size[kind] * count for _, kind, count in fields)
    return BlockLayout(name, int(GGMLQuantizationType[name]), block_size, nbytes, fields)


LAYOUTS: tuple[BlockLayout, ...] = (
    _layout("F32", 1, ("x", "f32", 1)),
    _layout("F16", 1, ("x", "f16", 1)),
    _layout("BF16", 1, ("x", "bf16", 1)),
    _layout("Q8_0", 32, ("d", "f16", 1), ("qs", "i8", 32)),
    _layout("Q4_0", 32, ("d", "f16", 1), ("qs", "u8", 16)),
    _layout("Q4_1", 32, ("d", "f16", 1), ("m", "f16", 1), ("qs", "u8", 16)),
    _layout("Q5_0", 32, ("d", "f16", 1), ("qh", "u8", 4), ("qs", "u8", 16)),
    _layout("Q5_1", 32, ("d", "f16", 1), ("m", "f16", 1), ("qh", "u8", 4), ("qs", "u8", 16)),
    _layout("MXFP4", 32, ("e", "u8", 1), ("qs", "u8", 16)),
    _layout(
        "Q4_K", 256, ("d", "f16", 1), ("dmin", "f16", 1), ("scales", "u8", 12), ("qs", "u8", 128)
    ),
    _layout(
        "Q5_K",
        256,
        ("d", "f16", 1),
        ("dmin", "f16", 1),
        ("scales", "u8", 12),
        ("qh", "u8", 32),
        ("qs", "u8", 128),
    ),
    _layout(
        "Q6_K", 256, ("ql", "u8", 128), ("qh", "u8", 64), ("scales", "i8", 16), ("d", "f16", 1)
    ),
)

# MXFP4's 16 codes (4-bit q): the OCP MX E2M1 values doubled, the sign in bit 3
MXFP4_VALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

BY_ID: dict[int, BlockLayout] = {layout.type_id: layout for layout in LAYOUTS}
BY_NAME: dict[str, BlockLayout] = {layout.name: layout for layout in LAYOUTS}
QUANTIZED: frozenset[int] = frozenset(t.type_id for t in LAYOUTS if t.block_size > 1)


def layout(type_id: int) -> BlockLayout:
    """The layout of ggml type `type_id`, or UnsupportedTypeError naming the supported ones."""
    try:
        return BY_ID[int(type_id)]
    except KeyError:
        names = ", ".join(t.name for t in LAYOUTS)
        raise UnsupportedTypeError(
            f"tensor type id {type_id} is not one tandem reads ({names})"
        ) from None
