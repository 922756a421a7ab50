"""The fast quantized linear layer (tandem/kernels/quant_linear.py) against the reference module
it replaces (the QuantLinear contract: dequantize, cast, F.linear), and a quantized model through
LocalExecutor: swapped and fused by the kernel preparation, the two-call decode layer over
quantized projections equal to the per-op path bit for bit, and the reference kept without the
native build."""

import copy

import numpy as np
import pytest
import torch
from quant_support import (
    DENSE_NAMES,
    QUANT_NAMES,
    RefQuantLinear,
    bound,
    dequant,
    magnitudes,
    quantize_model,
    random_blocks,
)
from tp_support import greedy_steps, random_reference, tiny_config

from tandem.engine.local import LocalExecutor
from tandem.kernels import decode_layer, decode_model, native, quant, quant_linear
from tandem.kernels.quant_linear import QuantKernelLinear, install_quant_kernels
from tandem.models.quant.blocks import BY_NAME

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

# q and k of one type, v of another (a fused group of mixed types, as Q4_K_M files have), the MLP
# and head of others: every kernel family in one model
TYPES = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_1",
         "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q5_0", "lm_head": "Q8_0"}  # fmt: skip


def _pick(types):
    return lambda name: types[name.rsplit(".", 1)[-1]]


def _ref_layer(name: str, rows: int, cols: int, seed: int, bias: bool) -> RefQuantLinear:
    rng = np.random.default_rng(seed)
    blocks = torch.from_numpy(random_blocks(name, rows, cols, rng))
    b = torch.randn(rows, generator=torch.Generator().manual_seed(seed)) if bias else None
    return RefQuantLinear(BY_NAME[name].type_id, cols, rows, blocks, b)


@pytest.mark.parametrize("name", QUANT_NAMES + DENSE_NAMES)
def test_fast_layer_equals_the_reference_module_within_the_kernel_bound(name):
    cols = 512 if BY_NAME[name].block_size == 256 else 224
    ref = _ref_layer(name, 41, cols, seed=5, bias=True)
    fast = quant_linear._fast([ref])
    assert isinstance(fast, QuantKernelLinear) and fast.qweight is ref.qweight  # no copy
    w = dequant(ref.qweight.numpy(), name)
    mags = magnitudes(ref.qweight.numpy(), name)
    for m in (1, 2, 3, 4, 19):  # decode sizes, then prefill
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        got, want = fast(x).double(), ref(x).double()
        lim = bound(x.double().numpy(), w, mags, name in QUANT_NAMES)
        lim = lim + 2.0**-23 * np.abs(want.numpy()) * 4  # the reference's own float32 product
        assert (np.abs(got.numpy() - want.numpy()) <= lim).all(), (name, m)


def test_a_quantized_model_is_swapped_and_fused_with_each_part_keeping_its_type():
    model = quantize_model(random_reference(tiny_config("Qwen3ForCausalLM")), _pick(TYPES))
    ex = LocalExecutor(model, max_batch=1, max_seq_len=32)
    layers = ex.model.model.layers
    for layer in layers.values():
        qkv, gu = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        assert isinstance(qkv, QuantKernelLinear) and layer.self_attn.q_proj is None
        assert qkv.qtypes == tuple(
            BY_NAME[TYPES[p]].type_id for p in ("q_proj", "k_proj", "v_proj")
        )
        assert isinstance(gu, QuantKernelLinear) and gu.qtypes == (3, 3)
        assert isinstance(layer.self_attn.o_proj, QuantKernelLinear)
        assert isinstance(layer.mlp.down_proj, QuantKernelLinear)
    assert isinstance(ex.model.lm_head, QuantKernelLinear)
    n = len(layers)
    assert ex.kernels.layers["quant"] == 4 * n + 1 and ex.kernels.fused == 2 * n


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_two_call_decode_layer_over_quantized_projections_equals_the_per_op_path(arch, monkeypatch):
    config = tiny_config(arch, mlp_bias=arch == "LlamaForCausalLM")
    model = quantize_model(random_reference(config), _pick(TYPES))
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


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_a_quantized_model_decodes_like_its_reference_modules(arch):
    """Prefill and 8 decode steps, float32: the native kernels against the reference modules
    (kernels="torch"). The kernels round activations to int8 per block of 32 (quant.py's bound:
    about 0.5% of a product per layer, compounding over the layers and the head: 2% of the logit
    spread measured here), so logits agree to 5% of their spread, not bit for bit; a wrong
    kernel is off by the whole spread."""
    model = quantize_model(random_reference(tiny_config(arch)), _pick(TYPES))
    ref = LocalExecutor(copy.deepcopy(model), max_batch=1, max_seq_len=32, kernels="torch")
    assert not any(isinstance(m, QuantKernelLinear) for m in ref.model.modules())
    fast = LocalExecutor(model, max_batch=1, max_seq_len=32)
    want, got = greedy_steps(ref, [3, 1, 4, 1, 5], 8), greedy_steps(fast, [3, 1, 4, 1, 5], 8)
    for (i, a), (j, b) in zip(want, got):
        assert i == j
        spread = (a.max() - a.min()).item()
        assert (a - b).abs().max().item() <= 0.05 * spread


def test_without_the_native_build_the_reference_modules_stay(monkeypatch):
    monkeypatch.setattr(quant, "available", lambda: False)
    model = quantize_model(random_reference(tiny_config()), _pick(TYPES))
    assert install_quant_kernels(model) == {"quant": 0, "quant_fused": 0}
    assert sum(isinstance(m, RefQuantLinear) for m in model.modules()) == 7 * 2 + 1


def test_the_greedy_head_argmax_is_the_argmax_of_the_layer_output():
    fast = quant_linear._fast([_ref_layer("Q6_K", 999, 256, seed=2, bias=False)])
    x = torch.randn(3, 256)
    assert torch.equal(fast.argmax(x), fast(x).argmax(-1))


def test_fast_layer_refuses_a_wrong_width_typed_and_takes_an_empty_input():
    fast = quant_linear._fast([_ref_layer("Q4_K", 8, 256, seed=1, bias=False)])
    with pytest.raises(quant.QuantKernelError, match="features"):
        fast(torch.randn(1, 512))  # 2x the width: as many elements as 2 rows
    with pytest.raises(quant.QuantKernelError, match="features"):
        fast(torch.randn(7, 128))
    assert fast(torch.randn(0, 256)).shape == (0, 8)
    with pytest.raises(quant.QuantKernelError):
        QuantKernelLinear([(torch.zeros(8, 100, dtype=torch.uint8), 12)], None, 256)
