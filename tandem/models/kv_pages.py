"""`KVPages`: a KV cache whose slots share physical memory for a shared prefix, the MMU as the
block table (vAttention: Prabhu et al., 2024), so every attention kernel reads an ordinary
strided array and none changes.

The cache is `planes` (one per layer and k|v), each (slots, G_p, S, hd) contiguous in VIRTUAL
memory, as a plain array would be. Every byte lives in one shared file mapping (a memfd,
MAP_SHARED). A slot's run of one head, (S, hd), is cut into blocks of `b` positions, the least b
with b * row_bytes a multiple of the page size (row_bytes = hd * dtype bytes; hd 64 in float32:
b = 16). S is rounded up to whole blocks.

    physical block (c, j)      block j (positions j*b .. j*b + b - 1) of physical column c, in
                               every plane and head: c < slots is slot c's own ("home") memory,
                               laid out as the virtual array is; c >= slots a spare column,
                               appended to the file on demand
    table[s, j] = c            slot s's block j reads and writes column c's block j (the MMU:
                               the virtual pages of (p, s, g, block j) map the file's pages of
                               (p, c, g, block j))
    ref[c, j]                  how many slots map (c, j); 0: its pages are punched out of the file
                               (fallocate PUNCH_HOLE), so its memory returns to the OS

Positions keep their place: block j of one slot only ever maps block j of a column, so a
sequence's virtual run stays contiguous and a run of blocks is contiguous in the file too.

    share(src, dst, n)         dst maps src's first m = n // b blocks (ref + 1; dst's old blocks
                               ref - 1): one mmap(MAP_FIXED) per (plane, head) per run of blocks
                               of one column, not one per block. Returns m * b: the caller copies
                               the partial last block's positions m*b .. n-1 itself (private)
    prepare_write(s, a, e)     before positions a..e-1 of slot s are written: each block there
                               that another slot maps too gets a fresh column (its bytes copied:
                               copy on write), so a block is immutable to its sharers
    release(s)                 slot s's blocks: exclusive ones punched; shared ones left to
                               their other holders (ref - 1), s remapped onto fresh zero
                               blocks (its home column where free)

The table is a pure function of the calls (share, prepare_write, release) in their order, so every
tensor-parallel rank and every pipeline stage that sees the same steps and copies holds the same
block ids with no message of its own (`engine.sequences`).

Mappings: a mmap inside an existing mapping splits it, so one run costs up to 3 VMAs. `vmas` is an
upper bound kept as the table changes (1 + 2 per (plane, head) per foreign run); a share that
would take it past `max_vmas` (a quarter of vm.max_map_count) is refused (returns 0: the caller
copies every byte, logged once). `KVPagesUnavailable` where the OS gives no memfd or mmap(MAP_FIXED)
(not Linux): the caller allocates a plain array and copies, logged once.

Fork: the mapping is MAP_SHARED, so a child forked (without exec) after the cache is built writes
the parent's KV cache; tandem's processes exec (`tandem worker`), none forks after loading.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
import weakref
from collections.abc import Sequence

import numpy as np

__all__ = ["KVPages", "KVPagesUnavailable", "block_positions", "warn_unavailable"]

log = logging.getLogger(__name__)

_PROT_RW = 0x1 | 0x2  # PROT_READ | PROT_WRITE
_MAP_SHARED, _MAP_FIXED = 0x01, 0x10
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_MAP_FAILED = ctypes.c_void_p(-1).value


class KVPagesUnavailable(OSError):
    """The OS gives no shared file mapping placeable at a fixed address (no memfd, no
    mmap(MAP_FIXED), no fallocate punch): the caller keeps a plain array and copies prefixes."""


_warned: set[str] = set()


def warn_unavailable(why: str) -> None:
    """Logs, once per process per reason, that prefix copies fall back to copying bytes."""
    if why not in _warned:
        _warned.add(why)
        log.warning("KV cache pages are not shared between sequences (%s): copies take bytes", why)


def block_positions(row_bytes: int, page: int = mmap.PAGESIZE) -> int:
    """The least b with b * row_bytes a multiple of `page`: page / gcd(page, row_bytes)."""
    return page // math.gcd(page, row_bytes)


class _Libc:
    def __init__(self) -> None:
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise KVPagesUnavailable(f"no memfd on {sys.platform}")
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self.mmap = libc.mmap
            self.munmap = libc.munmap
            self.fallocate = libc.fallocate
        except (OSError, AttributeError) as e:
            raise KVPagesUnavailable(f"libc has no mmap/fallocate: {e}") from None
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int64,
        ]  # fmt: skip
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


_libc: _Libc | None = None


def _lib() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def _close(lib: _Libc, fd: int, base: int, size: int) -> None:
    lib.munmap(base, size)
    os.close(fd)


class KVPages:
    """`slots` sequences' KV over `planes` (each plane's kv head count), `positions` positions
    of `row_bytes` each (module docstring). `array(first, count, dtype, hd)` views planes
    first..first+count-1 as one (count, slots, G, S, hd) array; `S` is `positions` rounded up."""

    def __init__(
        self, planes: Sequence[int], slots: int, positions: int, row_bytes: int,
        max_vmas: int | None = None,
    ) -> None:  # fmt: skip
        lib = _lib()
        self.lib = lib
        self.page = mmap.PAGESIZE
        self.b = block_positions(row_bytes, self.page)
        self.nb = -(-positions // self.b)  # blocks per run
        self.S = self.nb * self.b
        self.slots, self.row = slots, row_bytes
        self.heads = list(planes)
        self.bb = self.b * row_bytes  # bytes of one block of one head
        run = self.S * row_bytes  # one (plane, slot, head) run
        self.plane_off = np.cumsum([0] + [slots * g * run for g in self.heads])[:-1]
        self.spare_off = np.cumsum([0] + [g * run for g in self.heads])[:-1]
        self.home = int(sum(slots * g * run for g in self.heads))  # bytes of the virtual cache
        self.column = int(sum(g * run for g in self.heads))  # bytes of one spare column
        self.pg = [(p, g) for p, G in enumerate(self.heads) for g in range(G)]
        try:
            self.fd = os.memfd_create("tandem-kv", os.MFD_CLOEXEC)
        except OSError as e:
            raise KVPagesUnavailable(f"memfd_create: {e}") from None
        os.ftruncate(self.fd, max(self.home, self.page))
        base = lib.mmap(None, max(self.home, self.page), _PROT_RW, _MAP_SHARED, self.fd, 0)
        if base in (None, _MAP_FAILED):
            os.close(self.fd)
            raise KVPagesUnavailable(f"mmap: {os.strerror(ctypes.get_errno())}")
        self.base = base
        self._final = weakref.finalize(self, _close, lib, self.fd, base, max(self.home, self.page))
        self.table = np.tile(np.arange(slots, dtype=np.int64)[:, None], (1, self.nb))  # (slots, nb)
        self.ref = np.ones((slots, self.nb), np.int64)  # (columns, nb)
        self.written = np.zeros(slots, np.int64)  # blocks each slot may hold data in
        if max_vmas is None:
            max_vmas = _max_map_count() // 4
        self.max_vmas = max_vmas
        self.mmaps = 0  # mmap calls made (a count for the tests and the benchmark)
        self.punches = 0

    # ---- views ----------------------------------------------------------------------------

    def buffer(self) -> np.ndarray:
        """The whole virtual cache as bytes (home,) uint8; it keeps this object alive."""
        raw = (ctypes.c_char * self.home).from_address(self.base)
        raw._owner = self  # the mapping lives while any view of it does
        return np.frombuffer(raw, np.uint8)

    def array(self, first: int, count: int, dtype, hd: int) -> np.ndarray:
        """Planes first..first+count-1 (equal head counts) as (count, slots, G, S, hd)."""
        G = self.heads[first]
        if any(g != G for g in self.heads[first : first + count]):
            raise ValueError("planes of one array must have one kv head count")
        lo = int(self.plane_off[first])
        n = count * self.slots * G * self.S * self.row
        out = self.buffer()[lo : lo + n].view(dtype)
        return out.reshape(count, self.slots, G, self.S, hd)

    # ---- the block table ------------------------------------------------------------------

    def blocks(self, n: int) -> int:
        """Whole blocks in n positions."""
        return n // self.b

    def vmas(self) -> int:
        """An upper bound on the mappings the cache takes (module docstring)."""
        home = np.arange(self.slots)[:, None]
        foreign = self.table != home  # (slots, nb)
        starts = foreign[:, 0].sum() + (foreign[:, 1:] & ~foreign[:, :-1]).sum()
        changes = (self.table[:, 1:] != self.table[:, :-1]) & foreign[:, 1:] & foreign[:, :-1]
        return 1 + 2 * len(self.pg) * int(starts + changes.sum())

    def share(self, src: int, dst: int, n: int) -> int:
        """Slot `dst` maps slot `src`'s first n // b blocks; returns how many positions it now
        shares (0: none, the caller copies every byte). Module docstring."""
        m = n // self.b
        if m and not self._share_blocks(src, dst, m):
            m = 0
        if n > m * self.b:
            self.prepare_write(dst, m * self.b, n)  # the partial block: the caller's bytes
        return m * self.b

    def _share_blocks(self, src: int, dst: int, m: int) -> bool:
        before = self.table[dst, :m].copy()
        self.table[dst, :m] = self.table[src, :m]
        if self.vmas() > self.max_vmas:
            self.table[dst, :m] = before
            warn_unavailable(f"more than {self.max_vmas} mappings")
            return False
        self.table[dst, :m] = before
        changed = [j for j in range(m) if before[j] != self.table[src, j]]
        for j in changed:
            self.ref[self.table[src, j], j] += 1
        self._unref([(int(before[j]), j) for j in changed])
        for j in changed:
            self.table[dst, j] = self.table[src, j]
        for j0, j1 in _runs(changed, self.table[dst]):
            self._map(dst, j0, j1, int(self.table[dst, j0]))
        self.written[dst] = max(self.written[dst], m)
        return True

    def prepare_write(self, slot: int, start: int, end: int) -> None:
        """Before positions start..end-1 of `slot` are written: each block there that another
        slot maps too becomes the slot's own copy (module docstring)."""
        j0, j1 = start // self.b, min(-(-end // self.b), self.nb)
        if j1 > self.written[slot]:
            self.written[slot] = j1
        if j1 - j0 == 1 and self.ref[self.table[slot, j0], j0] == 1:
            return  # a decode token in a block of its own: the common case, kept cheap
        cols = self.table[slot, j0:j1]
        shared = [j0 + i for i in np.flatnonzero(self.ref[cols, np.arange(j0, j1)] > 1)]
        for a, e in _runs(shared, self.table[slot]):
            data = [self._block_bytes(slot, p, g, a, e) for p, g in self.pg]  # the old bytes
            self._move(slot, a, e)
            for (p, g), d in zip(self.pg, data):
                self._view(slot, p, g, a, e)[:] = d

    def release(self, slot: int) -> None:
        """`slot` holds nothing now: its exclusive blocks are punched, its shared ones left to
        their other holders and replaced by fresh ones (module docstring)."""
        m = int(self.written[slot])
        self.written[slot] = 0
        if m == 0:
            return
        row = self.table[slot, :m]
        own = np.flatnonzero((row == slot) & (self.ref[slot, :m] == 1)).tolist()
        for a, e in _runs(own, row):
            self._punch(slot, a, e)
        moved = np.flatnonzero((row != slot) | (self.ref[slot, :m] > 1)).tolist()
        for a, e in _runs(moved, row):
            self._move(slot, a, e)

    def resident_bytes(self) -> int:
        """Bytes of memory the file holds now (its allocated pages: shared ones once)."""
        return os.fstat(self.fd).st_blocks * 512

    def physical_blocks(self) -> int:
        """Physical blocks some slot maps and may have written (each counted once)."""
        cols = {
            (int(self.table[s, j]), j) for s in range(self.slots) for j in range(self.written[s])
        }
        return len(cols)

    # ---- the machinery --------------------------------------------------------------------

    def _move(self, slot: int, a: int, e: int) -> None:
        """Slot's blocks a..e-1 onto a fresh column (zeros), their old blocks unreferenced."""
        old = [(int(self.table[slot, j]), j) for j in range(a, e)]
        c = self._fresh(slot, a, e)
        self.ref[c, a:e] += 1
        self.table[slot, a:e] = c
        self._unref(old)
        self._map(slot, a, e, c)

    def _fresh(self, prefer: int, a: int, e: int) -> int:
        """A column whose blocks a..e-1 no slot maps: `prefer`'s home if free, else a spare,
        one appended (the file grows, sparse) when none is."""
        for c in [prefer, *range(self.slots, len(self.ref))]:
            if not self.ref[c, a:e].any():
                return c
        self.ref = np.vstack([self.ref, np.zeros((1, self.nb), np.int64)])
        os.ftruncate(self.fd, self._file_size())
        return len(self.ref) - 1

    def _file_size(self) -> int:
        return self.home + (len(self.ref) - self.slots) * self.column

    def _unref(self, blocks: list[tuple[int, int]]) -> None:
        """One reference less on each (column, j); those at 0 are punched, a run at a time."""
        dead: dict[int, list[int]] = {}
        for c, j in blocks:
            self.ref[c, j] -= 1
            if self.ref[c, j] == 0:
                dead.setdefault(c, []).append(j)
        for c, js in dead.items():
            for a, e in _runs(sorted(js), None):
                self._punch_column(c, a, e)

    def _punch(self, slot: int, a: int, e: int) -> None:
        self._punch_column(int(self.table[slot, a]), a, e)

    def _punch_column(self, c: int, a: int, e: int) -> None:
        for p, g in self.pg:
            off = self._file_off(c, p, g, a)
            if self.lib.fallocate(self.fd, _PUNCH, off, (e - a) * self.bb) != 0:
                raise KVPagesUnavailable(f"fallocate: {os.strerror(ctypes.get_errno())}")
            self.punches += 1

    def _map(self, slot: int, a: int, e: int, c: int) -> None:
        """The virtual pages of slot's blocks a..e-1 onto column c's, every plane and head."""
        for p, g in self.pg:
            addr = self.base + self._virt_off(slot, p, g, a)
            got = self.lib.mmap(
                addr, (e - a) * self.bb, _PROT_RW, _MAP_SHARED | _MAP_FIXED, self.fd,
                self._file_off(c, p, g, a),
            )  # fmt: skip
            if got != addr:
                raise KVPagesUnavailable(f"mmap(MAP_FIXED): {os.strerror(ctypes.get_errno())}")
            self.mmaps += 1

    def _virt_off(self, slot: int, p: int, g: int, j: int) -> int:
        G = self.heads[p]
        return int(self.plane_off[p]) + ((slot * G + g) * self.S + j * self.b) * self.row

    def _file_off(self, c: int, p: int, g: int, j: int) -> int:
        if c < self.slots:
            return self._virt_off(c, p, g, j)
        col = self.home + (c - self.slots) * self.column
        return col + int(self.spare_off[p]) + (g * self.S + j * self.b) * self.row

    def _view(self, slot: int, p: int, g: int, a: int, e: int) -> np.ndarray:
        lo = self._virt_off(slot, p, g, a)
        return self.buffer()[lo : lo + (e - a) * self.bb]

    def _block_bytes(self, slot: int, p: int, g: int, a: int, e: int) -> np.ndarray:
        return self._view(slot, p, g, a, e).copy()


def _runs(js: Sequence[int], row: np.ndarray | None) -> list[tuple[int, int]]:
    """Sorted block indices -> maximal runs (a, e) of consecutive ones whose `row` entries (the
    columns they map) are equal (row None: any)."""
    out: list[tuple[int, int]] = []
    for j in js:
        j = int(j)
        if out and out[-1][1] == j and (row is None or row[j] == row[out[-1][0]]):
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530
