"""`DecodeToken`: one decode token of one sequence in one native call (csrc/decode_token.c): the
embedding row, every layer, the final norm, the head and, for a greedy step, the argmax. What
stays fixed from token to token (the layer table, the head, the float32 (D) buffers, the cache
geometry) is one `TqDecodePlan` built here once; per token only the token id, the slot, the
position and two pointers cross ctypes, and nothing is allocated (a sampled step's logits go to
the array the caller gives, which the result then holds).

The RoPE rows (the global table's, and Gemma 3's local table's) come from a window of `WINDOW`
positions computed at once by `rope.Tables` (the same float32 numpy operations, element by
element, as for one position) and refreshed when a position leaves it. The embedding is
dequantized in C for the types csrc/decode_token.c lists
(F32, F16, BF16, Q8_0, Q4_0, Q4_1), else here by `LeanModel.embed` into the plan's buffer.
The logits and the id equal `LeanModel`'s step by step path bit for bit
(tests/unit/test_decode_token.py)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np

from tandem.kernels import library
from tandem.kernels.cstructs import TqDecodePlan
from tandem.kernels.lean import ops

if TYPE_CHECKING:
    from tandem.kernels.lean.model import LeanModel

WINDOW = 64  # RoPE rows computed at once


class DecodeToken:
    """`model`'s one-call decode token (module docstring)."""

    def __init__(self, model: LeanModel) -> None:
        layers, slot_stride, kv_strides = model._decode
        D = model.D
        self.model = model
        self.buf = np.zeros((3, D), np.float32)  # h, hn, scratch
        self.h = self.buf[0:1]  # (1, D): the residual stream, the embedding's row first
        self.vocab = model.head.out_features
        self.greedy_logits = np.empty(self.vocab, np.float32)  # a greedy step's, never returned
        self._greedy_ptr = self.greedy_logits.ctypes.data
        blocks = model.embed_blocks  # (vocab, row_bytes) as stored
        whole = blocks.ndim == 2 and blocks.flags.c_contiguous  # else embedded in numpy
        self.native_embed = whole and bool(
            library.library().tandem_embed_type_native(model.embed_type)
        )
        self._keep = (layers, kv_strides)  # the memory the plan's pointers name
        self.plan = TqDecodePlan(
            ctypes.addressof(layers), len(layers), slot_stride, ctypes.addressof(kv_strides),
            D, model.H, model.G, model.hd, model.config.intermediate_size, model.scale,
            model.norm.ctypes.data, model.eps, ctypes.addressof(model.head.desc), self.vocab,
            blocks.ctypes.data, model.embed_type, blocks.shape[0] if whole else 0,
            blocks.strides[0] if whole else 0,
            self.buf[0].ctypes.data, self.buf[1].ctypes.data, self.buf[2].ctypes.data,
            model.threads, model.config.embed_scale or 0.0,
        )  # fmt: skip
        self.plan_ptr = ctypes.addressof(self.plan)
        self._start = -2 * WINDOW  # the window's first position (none yet: no pos is in it)
        self._ptrs = (0, 0, None, None)  # the window's cos, sin, local cos, local sin
        self._keep_rope: tuple[np.ndarray, ...] = ()  # (WINDOW, hd) each
        self._row_bytes = model.hd * 4

    def _rope(self, pos: int) -> tuple[int, int, int | None, int | None]:
        """Pointers to the cos and sin rows (hd,) of `pos`, the global table's then the local
        table's (None where the model has one table)."""
        m = self.model
        if not 0 <= pos - self._start < WINDOW:
            self._start = pos - pos % WINDOW
            positions = np.arange(self._start, self._start + WINDOW)
            tables = m.rope.rows(positions)  # each row a decode token's
            if m.local_rope is not None:
                tables += m.local_rope.rows(positions)
            self._keep_rope = tables
            ptrs = [t.ctypes.data for t in tables]
            self._ptrs = (*ptrs, None, None)[:4]
        off = (pos - self._start) * self._row_bytes
        return tuple(None if p is None else p + off for p in self._ptrs)

    def __call__(self, slot: int, pos: int, token: int, logits: np.ndarray | None = None) -> int:
        """The token `token` of the sequence in cache slot `slot` at position `pos`: its argmax
        id where `logits` is None, else 0 with its logits (vocab,) written into `logits`
        (contiguous float32, the caller's)."""
        if logits is None:
            out, greedy = self._greedy_ptr, 1
        else:
            if logits.dtype != np.float32 or logits.size != self.vocab:
                raise ops.LeanKernelError(f"logits: float32 ({self.vocab},), got {logits.shape}")
            if not logits.flags.c_contiguous:
                raise ops.LeanKernelError("logits: a contiguous array")
            out, greedy = logits.ctypes.data, 0
        if not self.native_embed:
            self.h[:] = self.model.embed(np.array([token]))
            token = -1
        c, s, cl, sl = self._rope(pos)
        got = library.library().tandem_decode_token(
            self.plan_ptr, token, slot, pos, c, s, cl, sl, out, greedy
        )
        if got < 0:
            raise ops.LeanKernelError("the native decode token refused its arguments")
        return got
