"""Batch invariance of the native products over GGUF blocks (csrc/canon.h): a row's output is
bit-for-bit the same whether it is computed alone or among 1-4 rows (the decode kernels) or among
many (the prefill kernels, qgemm.c / qgemm256.c), for every type the kernels multiply, at widths
that leave partial groups of 16 blocks; and the AVX2 build (TANDEM_NATIVE_MARCH=haswell) computes
exactly what this CPU's build does."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_support import DENSE_NAMES, QUANT_NAMES, random_blocks

from tandem.kernels import native, quant
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
@pytest.mark.parametrize("name", ALL)
def test_a_rows_product_is_the_same_bits_alone_among_four_or_among_forty(name):
    check_invariant(name)


@needs_native
def test_the_avx2_build_is_batch_invariant_and_computes_this_builds_bits(tmp_path):
    """The -march=haswell build (AVX2: qdot256.h, qgemm256.c) runs the same check in a
    subprocess and saves its products, which equal this build's bit for bit."""
    here = Path(__file__).parent
    out = tmp_path / "avx2.npz"
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r})\n"
        "import numpy as np, test_batch_invariant_kernels as t\n"
        "from tandem.kernels import native\n"
        "assert native.available(), native.why()\n"
        "for n in t.ALL: t.check_invariant(n)\n"
        f"np.savez({str(out)!r}, **t.all_products())\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TANDEM_NATIVE_MARCH="haswell", TANDEM_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    theirs, ours = np.load(out), all_products()
    for key, y in ours.items():
        assert np.array_equal(theirs[key], y, equal_nan=True), key


@needs_native
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_both_kquant_prefill_kernels_this_cpu_runs_give_the_same_bits(name):
    """A call of K-quant parts only goes to the AVX2 prefill kernel (qgemm256.c) or the AVX-512
    one (qgemm.c), as tandem_kquant_prefill says: whichever it is, the products are the same
    bits (on an AVX2-only CPU qgemm.c declines and both settings run qgemm256.c)."""
    lib = native.library()
    before = lib.tandem_kquant_prefill(-1)
    try:
        got = []
        for choice in (0, 1):
            assert lib.tandem_kquant_prefill(choice) == choice
            got.append(np.concatenate(products(name, widths(name)[1], seed=3)))
    finally:
        lib.tandem_kquant_prefill(before)
    assert np.array_equal(got[0], got[1], equal_nan=True)
