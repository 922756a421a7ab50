"""The native GEMV over GGUF blocks (tandem/kernels/quant.py, csrc/qgemv.c) against a float64
product of gguf-py's dequantization, within the bound derived in quant_support.py, for every
type, 1-4 rows (decode) and many (prefill), odd row counts and widths with partial block groups;
every test once per ISA variant this host runs (kernel_variants.py: AVX2, AVX-VNNI, AVX-512 VNNI);
and typed refusals."""

import numpy as np
import pytest
import torch
from kernel_variants import each_variant
from quant_support import (
    DENSE_NAMES,
    QUANT_NAMES,
    bound,
    dequant,
    grid_x,
    magnitudes,
    random_blocks,
)

from tandem.kernels import native, quant
from tandem.models.quant.blocks import BY_NAME

needs_native = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")
pytestmark = pytest.mark.usefixtures(each_variant.__name__)
ALL = QUANT_NAMES + DENSE_NAMES


def _widths(name: str) -> tuple[int, ...]:
    # 32-blocks: 7 and 25 blocks leave a partial group of 4 (and of 8); K-quants whole superblocks
    return (256, 768) if BY_NAME[name].block_size == 256 else (224, 800)


def _x(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[:, rng.integers(0, cols, 3)] *= 50.0  # outliers: blocks whose scale one element sets
    return x


def check_type(name: str, rows: int, cols: int, m: int, seed: int, dtype=torch.float32) -> None:
    """One random case: the kernel's y within the bound of the float64 reference."""
    rng = np.random.default_rng(seed)
    blocks = random_blocks(name, rows, cols, rng)
    w, mags = dequant(blocks, name), magnitudes(blocks, name)
    for on_grid in (False, True):
        x = grid_x(m, cols, rng) if on_grid else _x(m, cols, rng)
        xt = torch.from_numpy(x).to(dtype)
        x64 = xt.double().numpy()  # the input as the kernel sees it (bf16 rounded)
        parts = quant.Parts([(torch.from_numpy(blocks), BY_NAME[name].type_id)], cols)
        y = quant.matmul(xt, parts)
        assert y.shape == (m, rows) and y.dtype == dtype
        ref = x64 @ w.T
        lim = bound(x64, w, mags, name in QUANT_NAMES, on_grid)
        if dtype != torch.float32:
            lim = lim + 2.0**-8 * np.abs(ref)
        err = np.abs(y.double().numpy() - ref)
        assert np.isfinite(y.double().numpy()).all()
        worst = (err - lim).max()
        assert worst <= 1e-30, (name, rows, cols, m, on_grid, float(worst))
        if on_grid and dtype == torch.float32:  # only float32 rounding left: a slip shows at O(1)
            assert (lim <= 1e-4 * (np.abs(x64) @ mags.T) + 1e-30).all()


@needs_native
def test_every_type_at_decode_and_both_prefill_kernels_row_counts() -> None:
    """Every type at 1-4 rows and prefills of 9 rows (the decode kernels, a partial group of 4)
    and 17 (the prefill kernels, a partial tile of 8 rows of X), odd row counts."""
    for i, name in enumerate(ALL):
        for cols in _widths(name):
            for m in (1, 2, 3, 4, 9, 17):
                check_type(name, rows=37 if m % 2 else 1, cols=cols, m=m, seed=100 * i + m)
    for name in ("Q4_0", "Q6_K"):  # bf16 in and out of the prefill kernels
        check_type(name, rows=37, cols=_widths(name)[0], m=17, seed=5, dtype=torch.bfloat16)


@needs_native
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_decode_gemv_is_the_float64_product_within_the_activation_rounding_bound(name, m):
    for cols in _widths(name):
        check_type(name, rows=37, cols=cols, m=m, seed=m)
        check_type(name, rows=1, cols=cols, m=m, seed=10 + m)


@needs_native
@pytest.mark.parametrize("name", ALL)
def test_prefill_product_of_many_rows_is_within_the_same_bound(name):
    check_type(name, rows=65, cols=_widths(name)[1], m=23, seed=7)


@needs_native
@pytest.mark.parametrize("name", DENSE_NAMES)
def test_dense_prefill_tiles_at_any_width_and_row_counts_are_within_the_bound(name):
    """The dense prefill tiles (csrc/gemm_dense512.c's 4 rows of W by 6 of X on an AVX-512 build,
    gemm_dense256.c's 2 by 6, a chunk's pairs block by block of 512 columns, on an AVX2 one; X
    copied to rows skewed off its stride): widths with a K % 16 tail (one under 16, one past one
    block, one past four), row counts of W and X that leave partial tiles and chunks; each row
    the decode kernel's bits."""
    for cols in (7, 203, 600, 2100):  # 2100: F32 chunks of fewer rows (dense_drive.h)
        for rows, m in ((1, 5), (3, 6), (4, 7), (9, 13), (37, 23), (53, 19)):
            rng = np.random.default_rng(rows * m + cols)
            blocks = random_blocks(name, rows, cols, rng)
            w, mags = dequant(blocks, name), magnitudes(blocks, name)
            x = _x(m, cols, rng)
            parts = quant.Parts([(torch.from_numpy(blocks), BY_NAME[name].type_id)], cols)
            y = quant.matmul(torch.from_numpy(x), parts).double().numpy()
            x64 = x.astype(np.float64)
            err = np.abs(y - x64 @ w.T) - bound(x64, w, mags, False, False)
            assert err.max() <= 1e-30, (name, rows, cols, m, float(err.max()))
            one = np.concatenate(
                [quant.matmul(torch.from_numpy(x[i : i + 1]), parts) for i in range(m)]
            )
            assert np.array_equal(y, one), (name, rows, cols, m)  # each row's decode bits


@needs_native
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "BF16"])
def test_bf16_activations_are_widened_and_the_output_rounded_once(name):
    for m in (2, 17):  # decode, prefill
        check_type(name, rows=37, cols=_widths(name)[0], m=m, seed=3, dtype=torch.bfloat16)


@needs_native
def test_fused_parts_of_mixed_types_equal_each_part_alone_bit_for_bit():
    rng = np.random.default_rng(0)
    names = ("Q4_K", "Q6_K", "Q8_0", "F32")
    ws = [(torch.from_numpy(random_blocks(n, r, 256, rng)), BY_NAME[n].type_id) for n, r in
          zip(names, (33, 8, 5, 3))]  # fmt: skip
    bias = torch.randn(49)
    x = torch.randn(3, 256)
    y = quant.matmul(x, quant.Parts(ws, 256), bias)
    alone = torch.cat([quant.matmul(x, quant.Parts([p], 256)) for p in ws], -1)
    assert torch.equal(y, alone + bias)


@needs_native
@pytest.mark.parametrize("name", DENSE_NAMES)
def test_a_dense_types_one_row_decode_form_gives_the_default_forms_bits(name, each_variant):
    """csrc/qgemv.c's two decode forms of a dense type (two rows of W a step with software
    prefetch; one row, the hardware prefetcher alone) sum each row in one order: the same bits
    at 1-4 rows of X, an odd row count (a last row the two-row form takes alone) and a width
    past K % 16 (the one-at-a-time tail); the form set is the one in force, and restored."""
    from tandem.kernels import library

    rng = np.random.default_rng(6)
    t = BY_NAME[name].type_id
    parts = quant.Parts([(torch.from_numpy(random_blocks(name, 301, 808, rng)), t)], 808)
    assert library.library().tandem_dense_form(t, -1) == 0  # unrouted: every build's default
    for m in (1, 2, 3, 4):
        x = torch.from_numpy(_x(m, 808, rng))
        two = quant.matmul(x, parts)
        try:
            library.set_dense_form(each_variant, t, 1)
            one = quant.matmul(x, parts)
        finally:
            library.set_dense_form(each_variant, t, 0)
        assert torch.equal(one, two), (name, m)
    with pytest.raises(library.NativeError, match="no decode form"):
        library.set_dense_form(each_variant, BY_NAME["Q4_0"].type_id, 1)


@needs_native
def test_result_does_not_depend_on_the_thread_count():
    rng = np.random.default_rng(1)
    parts = quant.Parts([(torch.from_numpy(random_blocks("Q4_0", 999, 800, rng)), 2)], 800)
    x = torch.randn(2, 800)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant.matmul(x, parts)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(quant.matmul(x, parts), one)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_fused_parts_split_over_threads_give_the_one_thread_result():
    """Decode hands each thread one contiguous run of 32-row chunks numbered across the parts,
    prefill chunks on demand: odd part sizes (runs that start and end inside a part), 1 and 4
    rows (decode), 19 (prefill), 1-3 threads."""
    rng = np.random.default_rng(4)
    names, rows = ("Q4_0", "Q4_K", "Q6_K", "Q5_1", "MXFP4"), (301, 77, 45, 99, 53)
    ws = [(torch.from_numpy(random_blocks(n, r, 768, rng)), BY_NAME[n].type_id) for n, r in
          zip(names, rows)]  # fmt: skip
    parts = quant.Parts(ws, 768)
    threads = torch.get_num_threads()
    try:
        for m in (1, 4, 19):
            x = torch.randn(m, 768)
            torch.set_num_threads(1)
            one = quant.matmul(x, parts)
            for t in (2, 3):
                torch.set_num_threads(t)
                assert torch.equal(quant.matmul(x, parts), one), (m, t)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_dense_prefill_over_thread_runs_gives_the_one_thread_result():
    """The dense prefill (csrc/dense_drive.h): each thread's contiguous run of chunks numbered
    across the parts, taken front to back with the next one read ahead, then the others' backs;
    parts of every dense type and odd sizes, F32 rows wide enough for chunks of fewer rows
    (K = 2100), 19 rows of X, 1-3 threads: the one-thread bits."""
    rng = np.random.default_rng(5)
    names, rows = ("F32", "BF16", "F16", "F32"), (61, 3, 50, 29)
    ws = [(torch.from_numpy(random_blocks(n, r, 2100, rng)), BY_NAME[n].type_id) for n, r in
          zip(names, rows)]  # fmt: skip
    parts = quant.Parts(ws, 2100)
    x = torch.randn(19, 2100)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant.matmul(x, parts)
        for t in (2, 3):
            torch.set_num_threads(t)
            assert torch.equal(quant.matmul(x, parts), one), t
    finally:
        torch.set_num_threads(threads)


def check_mxfp4_scales() -> None:
    """MXFP4 scales exactly as ggml forms them (2^(e - 128); e = 0, 1 subnormal), every exponent
    0..252 and every code: W row (e, c) is 9 blocks of exponent e all of code c; each row of X is
    one element 127 * 2^-20 (dx = 2^-20, q = 127) at a column that walks over all 9 blocks, so
    every product, scale and sum the kernels form is exact and y = 127 kv[c] 2^(e - 148) bit for
    bit: decode (1-4 rows) and prefill (17: qgemm.c on AVX-512, qgemm256.c on AVX2)."""
    from tandem.models.quant.blocks import MXFP4_VALUES

    e, c = np.meshgrid(np.arange(253), np.arange(16), indexing="ij")
    e, c = e.ravel().astype(np.uint8), c.ravel().astype(np.uint8)
    block = np.concatenate([e[:, None], np.repeat((c | c << 4)[:, None], 16, axis=1)], axis=1)
    w = torch.from_numpy(np.ascontiguousarray(np.tile(block, (1, 9))))  # (4048, 9 * 17)
    want = 127.0 * np.array(MXFP4_VALUES)[c] * 2.0 ** (e.astype(np.float64) - 148)
    parts = quant.Parts([(w, BY_NAME["MXFP4"].type_id)], 288)
    for m in (1, 4, 17):
        x = torch.zeros(m, 288)
        cols = (37 * torch.arange(m)) % 288
        x[torch.arange(m), cols] = 127.0 * 2.0**-20
        y = quant.matmul(x, parts).double().numpy()
        assert np.array_equal(y, np.broadcast_to(want, y.shape)), m


@needs_native
def test_mxfp4_scales_are_ggmls_exactly_for_every_exponent_and_code():
    check_mxfp4_scales()


@needs_native
def test_a_nan_activation_makes_the_outputs_nan_and_zeros_stay_exact():
    rng = np.random.default_rng(2)
    blocks = torch.from_numpy(random_blocks("Q4_K", 5, 256, rng))
    x = torch.zeros(2, 256)
    x[1, 7] = float("nan")
    y = quant.gemv(x, blocks, BY_NAME["Q4_K"].type_id)
    assert torch.equal(y[0], torch.zeros(5)) and y[1].isnan().all()


@needs_native
def test_wrong_width_type_shape_dtype_or_row_count_is_refused_typed():
    rng = np.random.default_rng(3)
    q4 = torch.from_numpy(random_blocks("Q4_0", 8, 256, rng))
    t = BY_NAME["Q4_0"].type_id
    cases = [
        (lambda: quant.gemv(torch.randn(1, 288), q4, t), "columns|uint8"),  # x wider than W
        (lambda: quant.gemv(torch.randn(1, 256), q4, 10), "not one tandem reads"),  # Q2_K
        (lambda: quant.gemv(torch.randn(1, 256), q4, 999), "not one tandem reads"),
        (lambda: quant.gemv(torch.randn(1, 256), q4[:, :100], t), "uint8"),
        (lambda: quant.gemv(torch.randn(1, 256), q4.view(torch.int8), t), "uint8"),
        (lambda: quant.gemv(torch.randn(1, 256), q4[::2], t), "contiguous"),
        (lambda: quant.gemv(torch.randn(5, 256), q4, t), "rows"),
        (lambda: quant.gemv(torch.randn(1, 256).double(), q4, t), "float32"),
        (lambda: quant.matmul(torch.randn(1, 224), quant.Parts([(q4, t)], 256)), "features"),
        (
            lambda: quant.matmul(torch.randn(1, 256), quant.Parts([(q4, t)], 256), torch.ones(3)),
            "bias",
        ),  # fmt: skip
    ]
    for call, match in cases:
        with pytest.raises(quant.QuantKernelError, match=match):
            call()
    assert issubclass(quant.QuantKernelError, native.NativeError)
