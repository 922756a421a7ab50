"""The native MoE experts (`kernels.moe.FastExperts`, csrc/moe.c) against the reference
`models.moe.Experts`: dense float32 within float32 summation order, bfloat16 within its rounding,
GGUF blocks bit for bit equal to the quantized GEMV run expert by expert on the same tokens (the
same int8 activations), only the chosen experts' weights read (an unchosen expert full of NaN
changes nothing), and experts outside the held range skipped. gpt-oss's experts (biases on every
projection, the down bias on one shard only, the clamped SwiGLU) take the same call."""

import pytest
import torch

from tandem.kernels import native, quant
from tandem.kernels.moe import FastExperts, install_expert_kernels
from tandem.models.moe import Experts
from tandem.models.quant.blocks import BY_NAME
from tandem.models.quant.linear import QuantExpertLinear
from tandem.models.quant.quantize import quantize

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native: {native.why()}")

E, D, W, K_TOP = 6, 64, 96, 2


def experts(dtype=torch.float32, first=0, count=E, seed=0, d=D, w=W) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(count, d, w, first)
    with torch.no_grad():
        for p in (ex.gate_proj, ex.up_proj, ex.down_proj):
            p.weight.copy_(torch.randn(p.weight.shape, generator=g) / p.in_features**0.5)
    return ex.to(dtype)


def fast(ex: Experts) -> Experts:
    ex.__class__ = FastExperts
    install_expert_kernels(ex)
    return ex


def routed(M: int, seed: int = 1, dtype=torch.float32, d: int = D):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(M)])
    w = torch.softmax(torch.randn(M, K_TOP, generator=g), -1).to(dtype)
    return x, w, ids


@pytest.mark.parametrize("M", [1, 3, 17])
def test_dense_float32_experts_equal_the_reference_up_to_summation_order(M):
    ref = experts()
    x, w, ids = routed(M)
    want = ref(x, w, ids)
    got = fast(experts())(x, w, ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_bfloat16_experts_equal_the_reference_within_its_rounding():
    x, w, ids = routed(9, dtype=torch.bfloat16)
    want = experts(torch.bfloat16)(x, w, ids).float()
    got = fast(experts(torch.bfloat16))(x, w, ids).float()
    assert got.dtype == torch.float32 and ((got - want).abs() <= 0.02 * want.abs() + 0.02).all()


def _quantized(ex: Experts, qtype: str) -> Experts:
    t = BY_NAME[qtype].type_id
    for name in ("gate_proj", "up_proj", "down_proj"):
        p = getattr(ex, name)
        blocks = torch.from_numpy(quantize(p.weight.detach().numpy(), t))  # (E, out, bytes)
        setattr(ex, name, QuantExpertLinear(t, p.n_experts, p.in_features, p.out_features, blocks))
    return ex


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "MXFP4", "Q4_K"])
@pytest.mark.parametrize("M", [1, 2, 11])
def test_gguf_experts_equal_the_quantized_gemv_expert_by_expert_bit_for_bit(qtype, M):
    d, w_ = (256, 512) if qtype == "Q4_K" else (D, W)  # K-quants: whole 256-element superblocks
    ex = _quantized(experts(d=d, w=w_), qtype)
    x, w, ids = routed(M, d=d)
    got = fast(ex)(x, w, ids)
    want = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.where(ids == e)
        if len(rows) == 0:
            continue
        gate, up, down = ex.gate_proj, ex.up_proj, ex.down_proj
        gu = quant.Parts([(gate.qweight[e], gate.qtype), (up.qweight[e], up.qtype)], d)
        act = native.silu_mul(quant.matmul(x[rows].contiguous(), gu))  # (n, 2W) -> (n, W)
        down = quant.Parts([(down.qweight[e], down.qtype)], w_)
        want.index_add_(0, rows, quant.matmul(act.contiguous(), down) * w[rows, slot, None])
    assert torch.equal(got, want)


def test_the_reference_math_stays_until_prepare_puts_the_experts_on_the_native_call():
    ref = _quantized(experts(), "Q8_0")
    x, w, ids = routed(5)
    want = ref(x, w, ids)
    ref.__class__ = FastExperts  # swapped by a runner, not prepared: still the plain math
    assert torch.equal(ref(x, w, ids), want)
    install_expert_kernels(ref)
    assert not torch.equal(ref(x, w, ids), want)  # int8 activations now


def test_an_unchosen_expert_is_never_read():
    ex = experts()
    with torch.no_grad():
        ex.gate_proj.weight[4] = float("nan")
        ex.down_proj.weight[4] = float("nan")
    x, w, _ = routed(5)
    ids = torch.tensor([[0, 1], [2, 3], [5, 0], [1, 2], [3, 5]])  # never expert 4
    assert torch.isfinite(fast(ex)(x, w, ids)).all()


def test_only_the_held_experts_contribute():
    full = experts()
    held = experts(first=2, count=3)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(held, name).weight.copy_(getattr(full, name).weight[2:5])
    x, w, ids = routed(7)
    want = full(x, w * ((ids >= 2) & (ids < 5)), ids)
    torch.testing.assert_close(fast(held)(x, w, ids), want, atol=2e-5, rtol=1e-5)


def gpt_oss_experts(seed=0, first=0, count=E, down_bias=True, dtype=torch.float32) -> Experts:
    """gpt-oss's experts: biases on every projection and the clamped SwiGLU (a low limit, so the
    clamps bite on these unit-scale inputs)."""
    from dataclasses import replace

    from tandem.models.presets import get_preset

    spec = replace(get_preset("tiny-gpt-oss").config.moe, swiglu_limit=1.5)
    g = torch.Generator().manual_seed(seed)
    ex = Experts(count, D, W, first, spec, down_bias)
    with torch.no_grad():
        for p in (ex.gate_proj, ex.up_proj, ex.down_proj):
            p.weight.copy_(torch.randn(p.weight.shape, generator=g) / p.in_features**0.5)
            if p.bias is not None:
                p.bias.copy_(torch.randn(p.bias.shape, generator=g) * 0.5)
    return ex.to(dtype)


@pytest.mark.parametrize("M", [1, 17])
@pytest.mark.parametrize("down_bias", [True, False])
def test_gpt_oss_clamped_biased_experts_equal_the_reference(M, down_bias):
    x, w, ids = routed(M)
    ref = gpt_oss_experts(down_bias=down_bias)
    want = ref(x, w, ids)
    pre = ref.gate_proj(x[:1], int(ids[0, 0]))
    assert (pre > 1.5).any() and (ref.up_proj(x[:1], int(ids[0, 0])).abs() > 1.5).any()
    got = fast(gpt_oss_experts(down_bias=down_bias))(x, w, ids)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["MXFP4", "Q8_0"])
def test_gpt_oss_quantized_experts_equal_the_reference_modules_within_int8_rounding(qtype):
    """The same experts over GGUF blocks: the native call against the reference modules
    (dequantize, F.linear, bias); they differ by the int8 rounding of the activations."""
    t = BY_NAME[qtype].type_id

    def as_blocks(ex):
        for name in ("gate_proj", "up_proj", "down_proj"):
            p = getattr(ex, name)
            blocks = quantize(p.weight.detach().reshape(-1, p.in_features).numpy(), t)
            q = torch.from_numpy(blocks).view(p.n_experts, p.out_features, -1)
            setattr(
                ex,
                name,
                QuantExpertLinear(t, p.n_experts, p.in_features, p.out_features, q, p.bias),
            )
        return ex

    x, w, ids = routed(5)
    want = as_blocks(gpt_oss_experts())(x, w, ids)
    got = fast(as_blocks(gpt_oss_experts()))(x, w, ids)
    assert not torch.equal(got, want)  # the native call ran: int8 activations
    assert (got - want).norm() <= 0.03 * want.norm()


_TWICE = """
import torch
from test_moe_kernels import experts, fast
for M in (1, 2, 5, 9):  # rows a call, each naming expert 3 twice
    x = torch.randn(M, 224)
    ids = torch.full((M, 2), 3)
    w = torch.full((M, 2), 0.5)
    for _ in range(20):
        fast(experts(d=224, w=32))(x, w, ids)
print("intact")
"""


@pytest.mark.parametrize("M", [1, 6])
def test_a_row_naming_one_expert_twice_sums_both_and_writes_within_its_buffers(M):
    """The conformance probe of a rank holding one expert names it twice in every row
    (`tp.conformance.probed_experts`): the expert takes 2 M rows, where a router's distinct
    top-k gives it at most M. Both contributions are summed as the reference sums them, and the
    call stays inside its buffers: glibc's checked allocator (MALLOC_CHECK_=3) aborts a process
    whose heap a call overran (csrc/moe.c sized them for M rows: 'free(): invalid next size')."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    x, w, _ = routed(M)
    ids = torch.full((M, K_TOP), 3)
    want = experts()(x, w, ids)
    torch.testing.assert_close(fast(experts())(x, w, ids), want, atol=2e-5, rtol=1e-5)
    env = {**os.environ, "MALLOC_CHECK_": "3", "PYTHONPATH": str(Path(__file__).parent)}
    r = subprocess.run([sys.executable, "-c", _TWICE], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0 and "intact" in r.stdout, r.stderr[-2000:]
