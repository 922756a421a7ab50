"""tandem's native per-layer decode operations (`tandem.kernels.native`, csrc/decode_ops.c) against
the PyTorch forms they replace: bit for bit in bf16 / f16 where the form's roundings are
reproduced (RMSNorm, q/k norm + RoPE, SwiGLU), within float32 rounding otherwise, and a whole
model's decode equal with and without them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tp_support import greedy_steps, random_reference, tiny_config

from tandem.engine.local import LocalExecutor
from tandem.kernels import native
from tandem.models.rope import apply_rope

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native ops: {native.why()}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1024, 100, 7])
def test_rmsnorm_is_f_rms_norm(dtype, dim):
    x = (torch.randn(5, 2 * dim, generator=_gen()) * 3).to(dtype)[:, :dim]  # strided rows
    w = (1 + 0.1 * torch.randn(dim, generator=_gen(1))).to(dtype)
    got, ref = native.rmsnorm(x, w, 1e-6), F.rms_norm(x, (dim,), w, 1e-6)
    assert got.shape == ref.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,hd", [(16, 128), (3, 6)])  # vector path, scalar path
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_in_place_is_rms_norm_then_apply_rope(dtype, heads, hd, with_norm):
    rows, width = 3, heads * hd
    qkv = torch.randn(rows, 2 * width, generator=_gen()).to(dtype)  # q is a strided view of it
    cos = torch.randn(rows, hd, generator=_gen(1)).to(dtype)
    sin = torch.randn(rows, hd, generator=_gen(2)).to(dtype)
    w = (1 + 0.1 * torch.randn(hd, generator=_gen(3))).to(dtype) if with_norm else None
    q = qkv[:, :width].view(rows, 1, heads, hd)  # (B, T, H, hd)
    normed = F.rms_norm(q, (hd,), w, 1e-6) if with_norm else q
    ref = apply_rope(normed, cos.view(rows, 1, 1, hd), sin.view(rows, 1, 1, hd))
    untouched = qkv[:, width:].clone()
    native.norm_rope_(qkv[:, :width], heads, w, 1e-6, cos, sin)
    assert torch.equal(qkv[:, width:], untouched)
    if dtype == torch.float32:
        torch.testing.assert_close(q, ref, atol=2e-6, rtol=1e-6)
    else:
        assert torch.equal(q, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_gate_times_up(dtype):
    gu = (torch.randn(3, 2 * 1000, generator=_gen()) * 4).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -89.0]).to(dtype)  # exp over/underflow edges
    gate, up = gu.chunk(2, -1)
    got, ref = native.silu_mul(gu), F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    else:  # a polynomial exp instead of Sleef's: at most one ulp, rarely
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
        diff = (got.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)
        assert diff.max().item() <= ulp and (got != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torch_argmax_ties_and_nan_included(dtype):
    x = torch.randn(4, 151936, generator=_gen()).to(dtype)
    x[1, 5] = x[1, 90000] = float("nan")  # the first NaN wins
    x[2, 7] = x[2, 9] = x[2].max() + 1  # a tie: the lower index
    x[3, -1] = 100.0  # the last element
    assert torch.equal(native.argmax(x), x.argmax(-1))
    assert torch.equal(native.argmax(x[:1, :13]), x[:1, :13].argmax(-1))  # scalar tail only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,G,R,S,hd", [(1, 8, 2, 37, 128), (3, 2, 4, 5, 64), (2, 2, 1, 1, 12)])
def test_decode_attention_is_sdpa_over_a_strided_cache_view(dtype, B, G, R, S, hd):
    qkv = torch.randn(B, G * R * hd + 2 * G * hd, generator=_gen()).to(dtype)
    q = qkv[:, : G * R * hd].view(B, G, R, hd)  # strided rows, as the attention passes it
    cache_k = torch.randn(B + 1, G, S + 9, hd, generator=_gen(1)).to(dtype)
    cache_v = torch.randn(B + 1, G, S + 9, hd, generator=_gen(2)).to(dtype)
    k, v = cache_k[1:, :, :S], cache_v[1:, :, :S]  # slots 1..B, first S positions
    got, ref = native.decode_attention(q, k, v), F.scaled_dot_product_attention(q, k, v)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    else:  # float32 throughout, one rounding; PyTorch's kernel rounds in between: <= 2 ulp
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
        scale = ref.float().abs().clamp_min(0.25)
        assert ((got.float() - ref.float()).abs() / scale).max().item() <= 2 * ulp


STARTS, LENGTHS = (0, 7, 4, 2), (5, 1, 3, 1)  # prefills at 0 and mid-cache, decode rows


def _step_case(dtype, G=2, R=2, hd=32, T=5, S=10):
    B = len(STARTS)
    qkv = torch.randn(B, T, G * R * hd + 2 * G * hd, generator=_gen()).to(dtype)
    q = qkv[..., : G * R * hd].view(B, T, G * R, hd)  # strided rows, as the attention passes it
    cache_k = torch.randn(B + 1, G, S + 3, hd, generator=_gen(1)).to(dtype)
    cache_v = torch.randn(B + 1, G, S + 3, hd, generator=_gen(2)).to(dtype)
    return q, cache_k[1:, :, :S], cache_v[1:, :, :S]  # slots 1..B, first S positions


def _step_reference(q, k, v, window, sinks):
    """float64, row by row: query (b, t) at pos = start + t against keys lo..pos, the sink in
    the softmax's denominator."""
    B, T, H, hd = q.shape
    R = H // k.shape[1]
    out = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for b, (s0, n) in enumerate(zip(STARTS, LENGTHS)):
        for t in range(n):
            pos = s0 + t
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(H):
                kk, vv = k[b, h // R, lo : pos + 1].double(), v[b, h // R, lo : pos + 1].double()
                z = kk @ q[b, t, h].double() * hd**-0.5
                extra = [] if sinks is None else [sinks[h].double()]
                m = torch.max(torch.cat([z, *(e[None] for e in extra)]))
                e = torch.exp(z - m)
                den = e.sum() + sum(torch.exp(x - m) for x in extra)
                out[b, t, h] = (e / den) @ vv
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_step_attention_is_each_rows_masked_attention_and_pads_with_zeros(
    dtype, window, with_sinks
):
    """A step of prefill chunks at any start and decode rows of different lengths, one call:
    each query row against its visible keys (causal, within the window), the sinks in the
    denominator, against float64; the padded rows zeros."""
    q, k, v = _step_case(dtype)
    sinks = torch.randn(q.shape[2], generator=_gen(3)).to(dtype) if with_sinks else None
    got = native.step_attention(q, k, v, STARTS, LENGTHS, window, sinks)
    ref = _step_reference(q, k, v, window, sinks)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]
    for b, n in enumerate(LENGTHS):
        assert (got[b, :n].double() - ref[b, :n]).abs().max().item() <= tol
        assert not got[b, n:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_step_attention_is_the_same_bits_alone_and_as_a_decode_step(dtype):
    """Each sequence of the step alone in its own call gives its rows bit for bit, and a decode
    row equals `decode_attention` over its keys (the one-token path's call)."""
    q, k, v = _step_case(dtype)
    whole = native.step_attention(q, k, v, STARTS, LENGTHS, 3)
    for b, (s0, n) in enumerate(zip(STARTS, LENGTHS)):
        alone = native.step_attention(q[b : b + 1, :n], k[b : b + 1], v[b : b + 1], (s0,), (n,), 3)
        assert torch.equal(alone[0], whole[b, :n])
    full = native.step_attention(q, k, v, STARTS, LENGTHS)
    b, pos = 1, STARTS[1]  # the decode row at position 7: keys 0..7
    G, R, hd = k.shape[1], q.shape[2] // k.shape[1], q.shape[3]
    one = native.decode_attention(
        q[b : b + 1, 0].reshape(1, G, R, hd), k[b : b + 1, :, : pos + 1], v[b : b + 1, :, : pos + 1]
    )
    assert torch.equal(one.reshape(-1), full[b, 0].reshape(-1))


@pytest.mark.parametrize("hd", [76, 8, 3])
def test_a_prefill_rows_attention_is_its_decode_steps_bits_and_sdpa_at_odd_sizes(hd):
    """The lean path's prefill attention (csrc/decode_ops.c attend_group: keys 4 at a time, exp
    and the denominator 8 keys at a time, values 64 lanes at a time) at key counts that leave
    every tail (1..21 keys) and head sizes with a tail of 8 (76) or under 8: each row equals the
    decode call over its prefix bit for bit and SDPA's causal attention within float32; a NaN key
    makes NaN exactly the rows that see it."""
    import numpy as np

    from tandem.kernels.lean import ops

    G, R, T = 2, 3, 21
    q = torch.randn(T, G * R * hd, generator=_gen())
    k, v = (
        torch.randn(G, T + 2, hd, generator=_gen(1)),
        torch.randn(G, T + 2, hd, generator=_gen(2)),
    )
    got = torch.from_numpy(ops.prefill_attention(q.numpy(), k.numpy(), v.numpy(), 0, hd**-0.5, 2))
    for t in range(T):
        one = native.decode_attention(
            q[t].view(1, G, R, hd), k[None, :, : t + 1], v[None, :, : t + 1]
        )
        assert torch.equal(one.reshape(-1), got[t]), t
    qh = q.view(T, G * R, hd).transpose(0, 1)  # (H, T, hd)
    kh, vh = (x[:, :T].repeat_interleave(R, 0) for x in (k, v))
    ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)
    torch.testing.assert_close(got.view(T, G * R, hd), ref, atol=1e-6, rtol=1e-5)
    k[1, 9, 0] = float("nan")
    got = ops.prefill_attention(q.numpy(), k.numpy(), v.numpy(), 0, hd**-0.5, 2).reshape(T, G, -1)
    assert np.isnan(got[9:, 1]).all() and not np.isnan(got[:9, 1]).any()
    assert not np.isnan(got[:, 0]).any()


def test_ops_refuse_what_they_cannot_run_with_a_typed_error():
    with pytest.raises(native.NativeError, match="rmsnorm"):
        native.rmsnorm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(native.NativeError, match="norm_rope"):
        native.norm_rope_(torch.randn(2, 12), 2, None, 1e-6, torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(native.NativeError, match="decode attention"):
        native.decode_attention(
            torch.randn(1, 2, 1, 8), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
        )
    with pytest.raises(native.NativeError, match="step attention"):  # keys past the cache
        native.step_attention(
            torch.randn(1, 2, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), (2,), (2,)
        )


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_a_model_decodes_the_same_with_and_without_the_native_ops(arch, monkeypatch):
    """Prefill and 10 decode steps through LocalExecutor: the native kernels and ops against
    F.linear and the PyTorch forms (native switched off), float32: same ids, logits within 1e-4."""
    ref_model = random_reference(tiny_config(arch)).eval()
    ours = LocalExecutor(copy.deepcopy(ref_model), max_batch=1, max_seq_len=64)
    got = greedy_steps(ours, [3, 1, 4, 1, 5], 10)
    monkeypatch.setattr(native, "handles", lambda t: False)
    ref = LocalExecutor(ref_model, max_batch=1, max_seq_len=64, kernels="torch")
    want = greedy_steps(ref, [3, 1, 4, 1, 5], 10)
    assert [i for i, _ in got] == [i for i, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_the_two_call_decode_layer_equals_the_per_op_native_path_bit_for_bit(
    arch, dtype, monkeypatch
):
    """decode_layer chains in C exactly the calls the per-op path makes from Python (qkv bias,
    q/k norm, cache write at the step's slot and position included): identical logits."""
    from tandem.kernels import decode_layer, decode_model

    config = tiny_config(arch, mlp_bias=arch == "LlamaForCausalLM")
    model = random_reference(config).to(dtype).eval()
    monkeypatch.setattr(decode_model, "run", lambda *a: None)  # the per-layer calls, not one
    calls = []
    real = decode_layer.run
    monkeypatch.setattr(decode_layer, "run", lambda *a: calls.append(1) or real(*a))
    blocks = LocalExecutor(copy.deepcopy(model), max_batch=2, max_seq_len=64)
    got = greedy_steps(blocks, [3, 1, 4, 1, 5], 8)
    assert len(calls) == 7 * config.num_hidden_layers  # every decode step of every layer
    monkeypatch.setattr(decode_layer, "eligible", lambda *a: False)
    per_op = LocalExecutor(model, max_batch=2, max_seq_len=64)
    want = greedy_steps(per_op, [3, 1, 4, 1, 5], 8)
    for (i, a), (j, b) in zip(got, want):
        assert i == j and torch.equal(a, b)
