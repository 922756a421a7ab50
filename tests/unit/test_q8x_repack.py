"""Q8_0 repacked in place (`Q8_0X`, tandem/kernels/repack.py, csrc/q8x.c): the bytes only move
(unpack undoes pack, in place too), and every product over the repacked rows is bit for bit the
product over the file's Q8_0 rows, for decode (1-4 rows of X) and prefill row counts, at widths
with whole and partial groups of 16 blocks, in every ISA build this host runs (the AVX-512,
AVX-VNNI and AVX2 kernels of the repacked layout each against the same build's Q8_0 kernels,
which test_batch_invariant_kernels.py holds to canon.h's one order)."""

import numpy as np
import pytest
import torch
from gguf import quants
from kernel_variants import each_variant
from quant_support import random_blocks

from tandem.kernels import native, quant, repack
from tandem.kernels.library import NativeError

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")
WIDTHS = (224, 512, 800, 1056)  # 7, 16, 25, 33 blocks a row: partial and whole groups of 16
GROUPS = [(0, 1), (1, 3), (3, 6), (6, 10), (10, 16), (16, 40), (0, 40)]  # 1-4 rows and prefill


def case(cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((40, cols)).astype(np.float32)
    x[:, rng.integers(0, cols, 3)] *= 50.0
    x[5, :] = 0.0
    return random_blocks("Q8_0", 37, cols, rng), x


@needs_native
@pytest.mark.parametrize("cols", WIDTHS)
def test_unpack_undoes_pack_and_pack_moves_every_byte(cols):
    w, _ = case(cols, seed=cols)
    packed = repack.pack(w, cols, out=np.empty_like(w))
    assert not np.array_equal(packed, w)
    assert np.array_equal(repack.unpack(packed, cols, out=np.empty_like(w)), w)
    inplace = w.copy()
    assert repack.pack(inplace, cols, threads=2) is inplace
    assert np.array_equal(inplace, packed)
    repack.unpack(inplace, cols)
    assert np.array_equal(inplace, w)


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
@pytest.mark.parametrize("cols", WIDTHS)
def test_products_over_repacked_rows_are_the_q8_0_products_bits(cols):
    w, x = case(cols, seed=3 * cols + 1)
    packed = repack.pack(w, cols, out=np.empty_like(w))
    plain = quant.Parts([(torch.from_numpy(w), repack.Q8_0)], cols)
    moved = quant.Parts([(torch.from_numpy(packed), repack.Q8_0X)], cols)
    for a, b in GROUPS:
        xs = torch.from_numpy(x[a:b])
        want, got = quant.matmul(xs, plain).numpy(), quant.matmul(xs, moved).numpy()
        assert np.array_equal(got, want, equal_nan=True), (cols, (a, b))
    # a fused call of both layouts (q/k/v of mixed types): each part its own kernel
    both = quant.Parts(
        [(torch.from_numpy(packed), repack.Q8_0X), (torch.from_numpy(w), repack.Q8_0)], cols
    )
    y = quant.matmul(torch.from_numpy(x[:2]), both).numpy()
    assert np.array_equal(y[:, :37], y[:, 37:], equal_nan=True)


@needs_native
def test_the_products_are_the_dequantized_weights_within_the_kernels_bound():
    """Against gguf-py's dequantization of the unrepacked rows (not this project's code): the
    activation rounding bound of tandem/kernels/quant.py, |y - x.w| <= sum_b dx_b/2 sum |w|."""
    cols = 800
    w, x = case(cols, seed=5)
    w[:, 0::34], w[:, 1::34] = 0x00, 0x20  # every block's float16 scale 2^-7: finite products
    ref = quants.dequantize(w, quants.GGMLQuantizationType.Q8_0).astype(np.float64)
    packed = repack.pack(w, cols, out=np.empty_like(w))
    y = quant.matmul(
        torch.from_numpy(x), quant.Parts([(torch.from_numpy(packed), repack.Q8_0X)], cols)
    )
    xb = x.reshape(40, -1, 32)
    dx = np.abs(xb).max(axis=2) / 127.0  # (40, nb)
    wabs = np.abs(ref).reshape(37, -1, 32).sum(axis=2)  # (37, nb)
    bound = (dx / 2) @ wabs.T + (cols / 32 + 8) * 2.0**-23 * (np.abs(x) @ np.abs(ref).T)
    assert np.all(np.abs(y.numpy() - x.astype(np.float64) @ ref.T) <= bound)


def test_a_weight_of_the_wrong_shape_or_a_read_only_one_is_refused():
    w = np.zeros((4, 34 * 7), np.uint8)
    with pytest.raises(NativeError):
        repack.pack(w, 256)
    with pytest.raises(NativeError):
        repack.pack(w[:, :-1], 224)
    w.flags.writeable = False
    with pytest.raises(NativeError):
        repack.pack(w, 224)


@needs_native
def test_a_packed_copy_of_a_mapped_weight_leaves_the_file_as_it_was(tmp_path):
    """What a model load does (packed_copy): the copy is pack()'s bytes, 64-byte aligned, and the
    mapped source still reads the file's bytes after its pages are released."""
    cols = 1024
    w, _ = case(cols, seed=9)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="c", shape=w.shape)
    copy = repack.packed_copy(mapped, cols, threads=2)
    assert copy.ctypes.data % 64 == 0
    assert np.array_equal(copy, repack.pack(w, cols, out=np.empty_like(w)))
    assert repack.release(mapped) > 0  # whole pages inside the mapping, dropped again
    assert np.array_equal(mapped, w)
    assert repack.release(w.copy()) == 0  # not a file's mapping: left alone


@needs_native
def test_a_packed_copy_releases_each_chunk_of_rows_before_packing_the_next(tmp_path, monkeypatch):
    """A weight past COPY_CHUNK is copied a chunk of rows at a time, each chunk's file pages
    released before the next is packed (so a tied head is not held twice whole at load), and
    the copy is the whole weight's repacking byte for byte."""
    cols = 1024
    w, _ = case(cols, seed=10)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="c", shape=w.shape)
    monkeypatch.setattr(repack, "COPY_CHUNK", 3 * w.shape[1])  # 3 rows a chunk
    events, pack, release = [], repack.pack, repack.release
    monkeypatch.setattr(repack, "pack", lambda a, *k, **kw: events.append(("pack", len(a)))
                        or pack(a, *k, **kw))  # fmt: skip
    monkeypatch.setattr(repack, "release", lambda a: events.append(("release", len(a)))
                        or release(a))  # fmt: skip
    copy = repack.packed_copy(mapped, cols, threads=2)
    chunks = [min(3, len(w) - r) for r in range(0, len(w), 3)]
    assert len(chunks) > 2
    assert events == [e for n in chunks for e in (("pack", n), ("release", n))] + [
        ("release", len(w))
    ]
    assert np.array_equal(copy, pack(w, cols, out=np.empty_like(w)))
    assert np.array_equal(mapped, w)


@needs_native
def test_the_torch_free_model_multiplies_its_q8_0_projections_repacked(tmp_path):
    """A Q8_0 file on the torch-free path: every projection (the tied head too) is a Q8_0X copy,
    the embedding still the file's Q8_0 rows (test_lean_executor.py holds its logits to the
    torch path's, which multiplies the file's rows)."""
    from tandem.engine.lean import LeanExecutor
    from tandem.loaders.gguf.writer import write_preset_gguf

    _, (f,) = write_preset_gguf(tmp_path / "q8.gguf", "tiny-qwen3", "Q8_0")
    model = LeanExecutor.from_file(f, max_batch=1, max_seq_len=16, threads=2).model
    lins = model.projections()
    assert {t for lin in lins for t in lin.types} == {repack.Q8_0X}
    assert model.embed_type == repack.Q8_0
    assert model.head.arrays[0].ctypes.data != model.embed_blocks.ctypes.data
