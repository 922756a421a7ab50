"""`Linear`: one projection of the torch-free path, `y = x W^T (+ b)` with W the row-stacked GGUF
parts as stored (a fused q/k/v or gate/up is one call over its parts, each of its own type), the
`tq_linear` the native calls take built once. Numpy views of the mapped file, no copy."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from tandem.kernels import library, repack
from tandem.kernels.cstructs import TqLinear, TqPart
from tandem.kernels.lean import ops


class LeanWeightError(ops.LeanKernelError):
    """A weight the native kernels cannot take as stored (type, width, layout)."""


def check_part(w: np.ndarray, type_id: int, in_features: int, name: str) -> None:
    """Raises LeanWeightError unless `w` is uint8 (rows, row_bytes) C-contiguous blocks of a type
    csrc/qgemv.c multiplies, `in_features` columns wide."""
    try:
        kind, want = library.kernel_row_bytes(type_id, in_features)
    except library.NativeError as e:
        raise LeanWeightError(f"{name}: {e}") from None
    if w.dtype != np.uint8 or w.ndim != 2 or w.shape[1] != want or not w.flags.c_contiguous:
        raise LeanWeightError(
            f"{name}: {kind} of {in_features} columns must be contiguous uint8 (rows, {want}), "
            f"got {w.dtype} {w.shape}"
        )


class Linear:
    """x (M, in_features) -> (M, out_features) float32 over `parts` [(blocks, type_id), ...]
    stacked by rows, with an optional float32 bias (out_features,)."""

    def __init__(
        self,
        parts: Sequence[tuple[np.ndarray, int]],
        in_features: int,
        bias: np.ndarray | None = None,
        name: str = "a linear layer",
    ) -> None:
        if not 1 <= len(parts) <= library.MAX_PARTS:
            raise LeanWeightError(f"{name}: 1..{library.MAX_PARTS} parts, got {len(parts)}")
        for w, t in parts:
            check_part(w, t, in_features, name)
        self.arrays = tuple(w for w, _ in parts)  # keeps the memory the pointers name
        self.types = tuple(int(t) for _, t in parts)
        self.in_features = in_features
        self.out_features = sum(w.shape[0] for w in self.arrays)
        if bias is not None:
            bias = np.ascontiguousarray(bias, dtype=np.float32)
            if bias.shape != (self.out_features,):
                raise LeanWeightError(f"{name}: bias {bias.shape} for {self.out_features} rows")
        self.bias = bias
        self.parts = (TqPart * len(parts))(
            *(TqPart(w.ctypes.data, w.shape[0], t) for w, t in zip(self.arrays, self.types))
        )
        self.desc = TqLinear(None, None if bias is None else bias.ctypes.data, 0, len(parts))
        self.desc.parts = ctypes.addressof(self.parts)

    def repack_q8_0(self, done: dict[int, np.ndarray], threads: int) -> None:
        """Its Q8_0 parts as Q8_0X copies (tandem/kernels/repack.py: the same products bit for
        bit; the file's pages released). `done` maps the first byte of each weight repacked so
        far to its copy, so a weight two projections share is repacked once."""
        arrays, types = list(self.arrays), list(self.types)
        for i, (w, t) in enumerate(zip(self.arrays, self.types, strict=True)):
            if t != repack.Q8_0:
                continue
            at = w.ctypes.data
            if at not in done or done[at].shape != w.shape:
                done[at] = repack.packed_copy(w, self.in_features, threads)
            arrays[i] = done[at]
            types[i] = repack.Q8_0X
            self.parts[i] = TqPart(arrays[i].ctypes.data, arrays[i].shape[0], repack.Q8_0X)
        self.arrays, self.types = tuple(arrays), tuple(types)

    def __call__(self, x: np.ndarray, threads: int) -> np.ndarray:
        """x (M, in) -> (M, out)."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ops.LeanKernelError(f"x {x.shape} for a weight of {self.in_features} columns")
        return ops.qgemv(np.ascontiguousarray(x), self.parts, self.bias, self.out_features, threads)
