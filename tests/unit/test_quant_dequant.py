"""Torch dequantization of every GGUF block type against gguf-py, the reference quantized modules,
and the quantizers the GGUF writer uses."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants

from tandem.models.quant.blocks import BY_NAME, LAYOUTS, UnsupportedTypeError
from tandem.models.quant.dequant import BlockShapeError, dequantize
from tandem.models.quant.linear import QuantEmbedding, QuantLinear, QuantShapeError
from tandem.models.quant.quantize import quantize

# float16 bit patterns of the scales: +-0, the smallest and largest subnormals, the smallest
# normal, 1, +-max, and a few ordinary values
EXTREME_F16 = np.array(
    [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x2E66, 0xB800, 0x1234],
    dtype=np.uint16,
)
_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}


def _offsets(t):
    out, offset = {}, 0
    for name, kind, count in t.fields:
        out[name] = (offset, kind, count)
        offset += _BYTES[kind] * count
    return out


def hostile_blocks(t, n_blocks: int, seed: int, scales: np.ndarray | None = None) -> np.ndarray:
    """(n_blocks, block_bytes): every byte column of the quant fields runs through all 256
    values (so every bit pattern of every quant, scale byte and high-bit byte occurs), and every
    f16 scale field takes each of `scales` (default EXTREME_F16) in turn."""
    rng = np.random.default_rng(seed)
    raw = np.stack([rng.permutation(256) for _ in range(t.block_bytes)], axis=1)
    raw = np.resize(raw, (n_blocks, t.block_bytes)).astype(np.uint8)
    scales = EXTREME_F16 if scales is None else scales
    for i, (off, kind, _count) in enumerate(_offsets(t).values()):
        if kind == "f16" and t.block_size > 1:
            picks = np.resize(np.roll(scales, 3 * i), n_blocks).astype(np.uint16)
            raw[:, off : off + 2] = picks.reshape(-1, 1).view(np.uint8)
    if t.name == "MXFP4":  # E8M0 exponents <= 252: finite values (the test below takes the rest)
        raw[:, 0] %= 253
    # plain floats: finite values only (NaN payloads differ, see the test below); an all-ones
    # exponent loses its top bit
    exponent = {"F32": (np.uint32, 0x7F800000, 0x40000000), "F16": (np.uint16, 0x7C00, 0x4000)}
    exponent["BF16"] = (np.uint16, 0x7F80, 0x4000)
    if t.name in exponent:
        kind, ones, top = exponent[t.name]
        vals = raw.view(kind)
        vals[(vals & ones) == ones] &= kind(~top & (2 ** (8 * np.dtype(kind).itemsize) - 1))
    return raw


def gguf_py(raw: np.ndarray, type_id: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return quants.dequantize(raw, type_id)


@pytest.mark.parametrize("t", LAYOUTS, ids=lambda t: t.name)
def test_dequant_equals_gguf_py_bit_for_bit_on_extreme_scales_and_every_quant_pattern(t):
    raw = hostile_blocks(t, 7 * 3 * 256 // t.block_size + 256, seed=t.type_id)
    for rows in (7, 1, 13):  # odd row counts, several blocks per row
        per_row = 3 if t.block_size > 1 else 96
        n = rows * per_row
        block = raw[:n].reshape(rows, per_row * t.block_bytes)
        want = gguf_py(block, t.type_id)
        got = dequantize(torch.from_numpy(block.copy()), t.type_id)
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    whole = dequantize(torch.from_numpy(raw.copy()), t.type_id).numpy()
    np.testing.assert_array_equal(whole.view(np.uint32), gguf_py(raw, t.type_id).view(np.uint32))


def test_mxfp4_every_exponent_and_code_is_gguf_py_bit_for_bit_inf_included():
    """Every E8M0 exponent 0..255 (e = 0, 1: the subnormal scales 2^-128, 2^-127; e = 255:
    2^127, not NaN, as ggml has it) with every code in every low and high nibble: finite up to
    e = 252, inf for the larger codes beyond (12 * 2^125 > FLT_MAX), bit for bit either way."""
    t = BY_NAME["MXFP4"]
    rng = np.random.default_rng(0)
    e = np.repeat(np.arange(256, dtype=np.uint8), 16)  # each exponent 16 times
    qs = rng.integers(0, 256, (e.size, 16), dtype=np.uint8)
    codes = np.tile(np.arange(16, dtype=np.uint8), 256)
    qs[np.arange(e.size), codes] = codes | (codes[::-1] << 4)  # every code low and high
    raw = np.concatenate([e[:, None], qs], axis=1).reshape(64, -1)  # 64 rows of 64 blocks
    want = gguf_py(raw, t.type_id)
    got = dequantize(torch.from_numpy(raw.copy()), t.type_id).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.isnan(want).any() and np.isinf(want).any()
    assert np.isfinite(want.reshape(-1, 32)[e <= 252]).all()
    sub = want.reshape(-1, 32)[e == 0]  # 2^-128 kv: the subnormals, exactly
    assert set(np.abs(sub.astype(np.float64)).ravel() * 2.0**128) == {0, 1, 2, 3, 4, 6, 8, 12}


@pytest.mark.parametrize(
    "t",
    [t for t in LAYOUTS if any(kind == "f16" for _, kind, _ in t.fields) and t.block_size > 1],
    ids=lambda t: t.name,
)
def test_infinite_and_nan_scales_give_inf_and_nan_exactly_where_gguf_py_does(t):
    """gguf-py (numpy) and torch widen NaN halves and form inf*0 with different NaN payload
    bits, so NaN positions are compared, and every other value bit for bit."""
    specials = np.array([0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x3C00, 0x0000], dtype=np.uint16)
    raw = hostile_blocks(t, 256, seed=1, scales=specials)
    want = gguf_py(raw, t.type_id)
    got = dequantize(torch.from_numpy(raw.copy()), t.type_id).numpy()
    nan = np.isnan(want)
    assert nan.any()
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_leading_dims_are_kept_and_bad_blocks_are_refused_typed():
    t = BY_NAME["Q4_K"]
    raw = torch.from_numpy(hostile_blocks(t, 6, seed=3)).reshape(3, 2, t.block_bytes)
    out = dequantize(raw, t.type_id)
    assert out.shape == (3, 2, 256)
    assert torch.equal(out.reshape(6, 256), dequantize(raw.reshape(6, -1), t.type_id))
    with pytest.raises(BlockShapeError, match="not whole 144-byte blocks"):
        dequantize(raw.reshape(3, -1)[:, :-1], t.type_id)
    with pytest.raises(BlockShapeError, match="uint8"):
        dequantize(raw.to(torch.int16), t.type_id)
    with pytest.raises(UnsupportedTypeError, match="4242"):
        dequantize(raw, 4242)


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = BY_NAME[type_name]
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5
    q = torch.from_numpy(quantize(w.numpy(), t.type_id))
    return w, q


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_is_f_linear_over_the_dequantized_weight(kind, dtype):
    _, q = _blocks(kind, 37, 512, seed=1)
    bias = torch.randn(37)
    lin = QuantLinear(BY_NAME[kind].type_id, 512, 37, q, bias)
    x = torch.randn(2, 3, 512).to(dtype)
    w = dequantize(q, BY_NAME[kind].type_id).to(dtype)
    assert torch.equal(lin(x), F.linear(x, w, bias.to(dtype)))
    assert lin(x).dtype == dtype
    assert "qweight" not in lin.state_dict() and lin.qweight.data_ptr() == q.data_ptr()


def test_quant_embedding_dequantizes_only_the_rows_looked_up_and_a_tied_head_shares_its_blocks():
    t = BY_NAME["Q6_K"]
    _, q = _blocks("Q6_K", 50, 256, seed=2)
    emb = QuantEmbedding(t.type_id, 50, 256, q, torch.bfloat16)
    ids = torch.tensor([[3, 49, 3], [0, 7, 11]])
    table = dequantize(q, t.type_id)
    assert torch.equal(emb(ids), table[ids].to(torch.bfloat16))
    head = emb.tied_head()
    assert head.qweight.data_ptr() == emb.qweight.data_ptr()
    h = torch.randn(4, 256)
    assert torch.equal(head(h), h @ table.T)


def test_blocks_of_the_wrong_shape_are_refused_naming_what_was_expected():
    _, q = _blocks("Q8_0", 4, 64, seed=0)
    with pytest.raises(
        QuantShapeError, match=r"Q8_0 blocks for \(4, 96\) must be uint8 \(4, 102\)"
    ):
        QuantLinear(BY_NAME["Q8_0"].type_id, 96, 4, q)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        QuantEmbedding(BY_NAME["Q8_0"].type_id, 4, 65, q)


@pytest.mark.parametrize(
    "kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]
)
def test_quantize_is_gguf_py_quantize_for_the_types_gguf_py_quantizes(kind):
    x = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    want = np.ascontiguousarray(quants.quantize(x, BY_NAME[kind].type_id)).view(np.uint8)
    np.testing.assert_array_equal(quantize(x, BY_NAME[kind].type_id), want.reshape(5, -1))


# rms error / rms value of Gaussian weights after the round trip: a 4-bit step over 32 values'
# range is ~0.27 sigma (rms error step/sqrt(12) ~ 0.08), 5 bits half that, Q6_K's 6 bits over a
# signed 16-value range a quarter of it; the bounds leave room for the 6/8-bit scale rounding
K_BOUNDS = {"Q4_K": 0.11, "Q5_K": 0.055, "Q6_K": 0.035}


@pytest.mark.parametrize("kind", list(K_BOUNDS))
def test_k_quant_packer_writes_valid_superblocks_near_the_weights(kind):
    t = BY_NAME[kind]
    x = np.random.default_rng(1).standard_normal((9, 512)).astype(np.float32)
    x[0] = 0.0  # all-zero superblocks
    x[1, :256] = np.abs(x[1, :256])  # no negative values: a zero min offset
    q = quantize(x, t.type_id)
    assert q.shape == (9, t.row_bytes(512)) and q.dtype == np.uint8
    back = gguf_py(q, t.type_id)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(q), t.type_id).numpy(), back)
    assert np.all(back[0] == 0)
    err = np.sqrt(np.mean((back[1:] - x[1:]) ** 2)) / np.sqrt(np.mean(x[1:] ** 2))
    assert err < K_BOUNDS[kind], err
