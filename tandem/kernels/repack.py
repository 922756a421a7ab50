"""Q8_0 weights repacked in place for the decode GEMV: `Q8_0X` (csrc/quant.h, csrc/q8x.c).

A Q8_0 row of nb blocks is nb (float16 scale, 32 int8 quants) = 34 nb bytes. Repacked, the same
row holds the nb scales first, then per group of 16 blocks 8 vectors of 64 bytes whose 4-byte
lane i carries the next 4 quants of block i (as w + 128): one 64-byte line feeds 16 blocks at
once, the scales of a group are one 32-byte load, and the integer dot of every block comes out
of one chain of 8 VPDPBUSD in its own lane, with no horizontal sums (llama.cpp's repacked CPU
path interleaves rows instead, which canon.h's per-row order does not allow).

The bytes are only moved: each block's integer dot, scale and place in canon.h's order are the
Q8_0 kernel's, so a product over Q8_0X rows is bit for bit the product over the Q8_0 rows they
came from, at every row count (decode and prefill) and in every ISA build. A row keeps its byte
count, so row slices stay whole rows.

`packed_copy` is what a model load does: the repacked rows in a new 64-byte-aligned buffer, then
the source's whole pages dropped from the process (madvise MADV_DONTNEED) where it is a view of a
mapped file, so the resident memory holds the weight once (the file's bytes stay as they are: a
later read of the mapping, the tied embedding's rows say, faults them in again from the page
cache). The copy goes COPY_CHUNK bytes of rows at a time, each chunk's source pages dropped
before the next: at most that much of the file is held twice.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from tandem.kernels.library import REPACKED, NativeError, library
from tandem.models.quant.blocks import BY_NAME

Q8_0 = BY_NAME["Q8_0"].type_id
Q8_0X = next(t for t, (name, _) in REPACKED.items() if name == "Q8_0X")


def _check(w: np.ndarray, in_features: int) -> int:
    if in_features < 32 or in_features % 32:
        raise NativeError(f"Q8_0: {in_features} columns is not whole blocks of 32")
    rb = in_features // 32 * 34
    if w.dtype != np.uint8 or w.ndim != 2 or w.shape[1] != rb or not w.flags.c_contiguous:
        raise NativeError(f"a Q8_0 weight of {in_features} columns is uint8 (rows, {rb}), C order")
    return rb


def _run(
    fn: str, w: np.ndarray, in_features: int, out: np.ndarray | None, threads: int
) -> np.ndarray:
    _check(w, in_features)
    dst = w if out is None else out
    if dst is not w:
        _check(dst, in_features)
        if dst.shape != w.shape:
            raise NativeError(f"out {dst.shape} for a weight {w.shape}")
    if not dst.flags.writeable:
        raise NativeError("the repacked rows' array is read-only")
    rc = getattr(library(), fn)(w.ctypes.data, dst.ctypes.data, w.shape[0], in_features, threads)
    if rc != 0:
        raise NativeError(f"{fn} failed ({rc})")
    return dst


def pack(
    w: np.ndarray, in_features: int, out: np.ndarray | None = None, threads: int = 1
) -> np.ndarray:
    """Q8_0 rows `w` (rows, 34 in/32) -> Q8_0X, into `out` or in place (w itself, returned)."""
    return _run("tandem_q8x_pack", w, in_features, out, threads)


def unpack(
    w: np.ndarray, in_features: int, out: np.ndarray | None = None, threads: int = 1
) -> np.ndarray:
    """Q8_0X rows back to Q8_0 as the file stores them, into `out` or in place."""
    return _run("tandem_q8x_unpack", w, in_features, out, threads)


_MADV_DONTNEED = 4  # Linux
# rows repacked, then released, at a time: a tied 151936 x 1024 head (165 MB of Q8_0) copied
# whole held both at once, the load's peak RSS 1.24x a 636 MB file (1.03x its resident end)
COPY_CHUNK = 8 << 20


def _mapped(a: np.ndarray) -> bool:
    """`a` is a view of a memory-mapped file (np.memmap or mmap.mmap at the end of its bases)."""
    b = a
    while b is not None:
        if isinstance(b, (np.memmap, mmap.mmap)):
            return True
        b = getattr(b, "base", None)
    return False


def release(a: np.ndarray) -> int:
    """Drops the whole pages inside the file-mapped array `a` from this process's resident memory
    (they read back from the page cache if touched again); an array not mapped from a file is
    left alone. Returns the bytes dropped (0 where nothing was)."""
    if not _mapped(a):
        return 0
    page = mmap.PAGESIZE
    lo = -(-a.ctypes.data // page) * page
    hi = (a.ctypes.data + a.nbytes) // page * page
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return hi - lo if libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0 else 0


def packed_copy(w: np.ndarray, in_features: int, threads: int = 1) -> np.ndarray:
    """Q8_0 rows `w` repacked to Q8_0X in a new 64-byte-aligned array, and `w`'s pages released
    where it is a view of a mapped file (module docstring), COPY_CHUNK bytes of rows at a time."""
    _check(w, in_features)
    raw = np.empty(w.nbytes + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    out = raw[skip : skip + w.nbytes].reshape(w.shape)
    step = max(1, COPY_CHUNK // max(1, w.shape[1]))  # rows
    for r in range(0, w.shape[0], step):
        pack(w[r : r + step], in_features, out=out[r : r + step], threads=threads)
        release(w[r : r + step])
    release(w)  # the pages the chunks' edges shared
    return out
