"""`KVPages`: a shared prefix is the same physical pages (a write through one slot's mapping is
seen through the other's, for whole blocks only), a released or rewritten source leaves the
sharer's bytes exact, and freed blocks return their memory (the memfd's allocated pages)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tandem.models import kv_pages
from tandem.models.kv_pages import KVPages, block_positions

try:
    kv_pages._lib()
except kv_pages.KVPagesUnavailable as e:  # not Linux: the executors copy instead
    pytest.skip(f"no shared KV pages here: {e}", allow_module_level=True)

HD, G, L, SLOTS, S = 64, 2, 3, 4, 100


def _cache() -> tuple[KVPages, np.ndarray]:
    pages = KVPages([G] * L, SLOTS, S, HD * 4)
    return pages, pages.array(0, L, np.float32, HD)  # (L, slots, G, S', hd)


def test_block_is_the_least_whole_page_run():
    assert block_positions(64 * 4) == mmap.PAGESIZE // 256  # 16 positions on 4 KiB pages
    assert block_positions(128 * 2) == mmap.PAGESIZE // 256
    assert block_positions(3 * 4) == mmap.PAGESIZE // 4  # gcd(4096, 12) = 4
    assert block_positions(2 * mmap.PAGESIZE) == 1


def test_shared_blocks_are_one_page_the_partial_block_is_private():
    pages, k = _cache()
    b = pages.b
    rng = np.random.default_rng(0)
    k[:, 0, :, :50] = rng.standard_normal((L, G, 50, HD), dtype=np.float32)
    n = 2 * b + 5  # two whole blocks and five positions of a third
    shared = pages.share(0, 1, n)
    assert shared == 2 * b
    k[:, 1, :, shared:n] = k[:, 0, :, shared:n]  # the caller's copy of the partial block
    np.testing.assert_array_equal(k[:, 1, :, :n], k[:, 0, :, :n])
    # one physical page: a write through slot 0 shows through slot 1, within the whole blocks
    k[2, 0, 1, b + 3, 7] = 123.0
    assert k[2, 1, 1, b + 3, 7] == 123.0
    # the partial block is slot 1's own: a write there is not seen through slot 0
    k[0, 1, 0, 2 * b + 1, 0] = -7.0
    assert k[0, 0, 0, 2 * b + 1, 0] != -7.0
    # one mmap per (layer, head) for the run of two blocks, not one per block
    assert pages.mmaps == L * G


def test_release_and_rewrite_of_the_source_keep_the_sharers_bytes():
    pages, k = _cache()
    b = pages.b
    rng = np.random.default_rng(1)
    k[:, 0, :, :64] = rng.standard_normal((L, G, 64, HD), dtype=np.float32)
    pages.prepare_write(0, 0, 64)
    pages.share(0, 1, 64)
    pages.share(0, 2, 3 * b)
    want1, want2 = k[:, 1, :, :64].copy(), k[:, 2, :, : 3 * b].copy()
    # the source rewinds into a shared block (copy on write), then is released
    pages.prepare_write(0, b + 2, b + 3)
    k[:, 0, :, b + 2] = 9.0
    np.testing.assert_array_equal(k[:, 1, :, :64], want1)
    np.testing.assert_array_equal(k[:, 0, :, : b + 2], want1[:, :, : b + 2])  # kept on write
    pages.release(0)
    assert not k[:, 0].any()  # fresh zero blocks
    np.testing.assert_array_equal(k[:, 1, :, :64], want1)
    np.testing.assert_array_equal(k[:, 2, :, : 3 * b], want2)
    # the slot taken again and written: its own memory, not its former sharers'
    pages.prepare_write(0, 0, 64)
    k[:, 0, :, :64] = 5.0
    np.testing.assert_array_equal(k[:, 1, :, :64], want1)
    pages.release(1)
    np.testing.assert_array_equal(k[:, 2, :, : 3 * b], want2)


def test_sharing_costs_no_memory_and_freed_blocks_return_it():
    pages, k = _cache()
    k[:, 0, :, :96] = 1.0
    pages.prepare_write(0, 0, 96)
    one = pages.resident_bytes()
    assert one >= L * G * 96 * HD * 4
    for dst in (1, 2, 3):
        assert pages.share(0, dst, 96) == 96
    assert pages.resident_bytes() == one  # four sequences, one copy of the prefix
    assert pages.physical_blocks() == 96 // pages.b
    for s in (0, 1, 2):
        pages.release(s)
    assert pages.resident_bytes() == one  # slot 3 still maps them
    pages.release(3)
    assert pages.resident_bytes() == 0  # punched: the memory is back


def test_vma_bound_refuses_sharing_and_the_caller_copies():
    pages = KVPages([G] * L, SLOTS, S, HD * 4, max_vmas=10)
    k = pages.array(0, L, np.float32, HD)
    k[:, 0, :, :40] = 2.0
    assert pages.share(0, 1, 40) == 0  # 2 * L * G foreign runs would pass 10
    assert pages.mmaps == 0
    assert not k[:, 1].any()  # nothing mapped: the caller's bytes to copy


def test_mapping_count_stays_within_the_estimate():
    pages, k = _cache()
    before = _maps()
    for dst in (1, 2, 3):
        pages.share(0, dst, 64)
    assert _maps() - before <= pages.vmas()
    for s in (1, 2, 3):
        pages.release(s)
    assert _maps() - before <= 2  # back home: the runs merge again


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_without_shared_pages_both_caches_are_plain_arrays_logged_once(monkeypatch, caplog):
    """Where the OS gives no placeable shared mapping (`KVPagesUnavailable`, e.g. macOS), the
    torch cache and the torch-free one are plain zeroed arrays, a copy takes bytes, and the
    fallback is logged once per reason."""
    import torch

    from tandem.kernels.lean.model import kv_arrays
    from tandem.models.kv_cache import KVCache

    def unavailable():
        raise kv_pages.KVPagesUnavailable("no memfd on testos")

    monkeypatch.setattr(kv_pages, "_lib", unavailable)
    monkeypatch.setattr(kv_pages, "_warned", set())
    with caplog.at_level("WARNING", logger=kv_pages.__name__):
        cache = KVCache([0, 1], 2, 40, 2, HD, torch.float32)
        pages, k, v = kv_arrays(L, 2, G, 40, HD)
    assert cache.pages is None and pages is None
    assert k.shape == v.shape == (L, 2, G, 40, HD) and not k.any()
    cache.k[1][0, :, :33] = torch.arange(33.0)[None, :, None]
    cache.copy_prefix(0, 1, 33)
    assert torch.equal(cache.k[1][1, :, :33], cache.k[1][0, :, :33])
    assert sum("testos" in r.getMessage() for r in caplog.records) == 1
