"""Batch invariance of the native products over GGUF blocks (csrc/canon.h): a row's output is
bit-for-bit the same whether it is computed alone or among 1-4 rows (the decode kernels) or among
many (the prefill kernels, qgemm.c / qgemm256.c), for every type the kernels multiply, at widths
that leave partial groups of 16 blocks; in every ISA variant this host runs (kernel_variants.py),
and every variant computes exactly the AVX2 build's bits."""

import numpy as np
import pytest
import torch
from kernel_variants import NAMES, each_variant
from quant_support import DENSE_NAMES, QUANT_NAMES, random_blocks

from tandem.kernels import library, native, quant
from tandem.models.quant.blocks import BY_NAME

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")
ALL = QUANT_NAMES + DENSE_NAMES
ROWS_W, ROWS_X = 37, 40
# row groups of X each multiplied alone: decode sizes at odd offsets, prefill sizes on both sides
# of qgemm256.c's 16-row threshold, and the whole
GROUPS = [(0, 1), (7, 8), (3, 5), (11, 14), (20, 24), (1, 6), (9, 18), (4, 21), (17, 40), (0, 40)]


def widths(name: str) -> tuple[int, ...]:
    """32-element blocks: 7, 16, 25 and 33 per row (partial and whole groups of 16); K-quants
    1, 3 and 4 superblocks (half and whole groups of 16 sub-blocks); the dense types also 203
    columns (a tail of 11 past the 16-column steps)."""
    if BY_NAME[name].block_size == 1:
        return (203, 224, 512, 800, 1056)
    return (256, 768, 1024) if BY_NAME[name].block_size == 256 else (224, 512, 800, 1056)


def case(name: str, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS_X, cols)).astype(np.float32)
    x[:, rng.integers(0, cols, 3)] *= 50.0
    x[5, :] = 0.0  # a row of zero blocks
    return random_blocks(name, ROWS_W, cols, rng), x


def products(name: str, cols: int, seed: int) -> list[np.ndarray]:
    """Each group of rows of X multiplied in its own call (float32 out)."""
    blocks, x = case(name, cols, seed)
    parts = quant.Parts([(torch.from_numpy(blocks), BY_NAME[name].type_id)], cols)
    return [quant.matmul(torch.from_numpy(x[a:b]), parts).numpy() for a, b in GROUPS]


def check_invariant(name: str) -> None:
    for k, cols in enumerate(widths(name)):
        got = products(name, cols, seed=17 * k + len(name))
        whole = got[GROUPS.index((0, ROWS_X))]
        for (a, b), y in zip(GROUPS, got, strict=True):
            diff = np.flatnonzero((y != whole[a:b]).any(axis=1) & ~np.isnan(y).any(axis=1))
            assert diff.size == 0, (name, cols, (a, b), (a + diff).tolist())


def all_products() -> dict[str, np.ndarray]:
    return {
        f"{name}-{cols}": np.concatenate(products(name, cols, seed=17 * k + len(name)))
        for name in ALL
        for k, cols in enumerate(widths(name))
    }


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
@pytest.mark.parametrize("name", ALL)
def test_a_rows_product_is_the_same_bits_alone_among_four_or_among_forty(name):
    check_invariant(name)


@needs_native
@pytest.mark.parametrize("variant", [n for n in NAMES if n != "avx2"] or ["none"])
def test_every_variant_computes_the_avx2_builds_bits(variant):
    """AVX-VNNI's VPDPBUSD and AVX-512's wider kernels (qdot512.h, qgemm.c) sum the same
    integer dots in canon.h's one order as the AVX2 kernels (qdot256.h, qgemm256.c): every
    product of every type, decode and prefill row groups, the same bits."""
    if variant == "none":
        pytest.skip("this host runs the AVX2 build only")
    with library.using("avx2"):
        theirs = all_products()
    with library.using(variant):
        ours = all_products()
    for key, y in ours.items():
        assert np.array_equal(theirs[key], y, equal_nan=True), (variant, key)


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_both_kquant_prefill_kernels_this_cpu_runs_give_the_same_bits(name):
    """A call of K-quant parts only goes to the AVX2 prefill kernel (qgemm256.c) or the AVX-512
    one (qgemm.c), as tandem_kquant_prefill says: whichever it is, the products are the same
    bits (in a build without AVX-512 qgemm.c declines and both settings run qgemm256.c)."""
    lib = library.library()
    before = lib.tandem_kquant_prefill(-1)
    try:
        got = []
        for choice in (0, 1):
            assert lib.tandem_kquant_prefill(choice) == choice
            got.append(np.concatenate(products(name, widths(name)[1], seed=3)))
    finally:
        lib.tandem_kquant_prefill(before)
    assert np.array_equal(got[0], got[1], equal_nan=True)


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
@pytest.mark.parametrize("name", ALL)
def test_a_weight_rows_product_does_not_depend_on_the_rows_beside_it(name):
    """The decode kernels take several rows of W a step where it pays (qgemv.c DEFINE_ROWS_N:
    Q8_0 on AVX-512, the dense types), the chunk's odd last row alone: each row of W, multiplied
    among all 37, among the rows from 1 on (every pairing shifted by one) and alone, gives the
    same bits, at 1 and 3 rows of X."""
    cols = widths(name)[1]
    blocks, x = case(name, cols, seed=5)
    t = BY_NAME[name].type_id

    def mul(w: np.ndarray, rows: int) -> np.ndarray:
        parts = quant.Parts([(torch.from_numpy(np.ascontiguousarray(w)), t)], cols)
        return quant.matmul(torch.from_numpy(x[:rows]), parts).numpy()

    for rows in (1, 3):
        whole = mul(blocks, rows)
        assert np.array_equal(mul(blocks[1:], rows), whole[:, 1:], equal_nan=True), (name, rows)
        for r in (0, 5, 31, 32, 36):
            assert np.array_equal(mul(blocks[r : r + 1], rows), whole[:, r : r + 1], equal_nan=True)
