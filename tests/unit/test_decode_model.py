"""The one-call decode of a model's layers (tandem/kernels/decode_model.py, csrc/decode_model.c)
against the two-call-per-layer path it chains (decode_layer.py): bit for bit, dense (float32,
bf16) and quantized, at a cache slot other than 0, and the per-layer path kept where a layer is
not eligible."""

import copy

import pytest
import torch
from quant_support import quantize_model
from tp_support import random_reference, tiny_config

from tandem.engine.executor import Step, StepSequence
from tandem.engine.local import LocalExecutor
from tandem.kernels import decode_layer, decode_model, native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

# every 32-element kernel family, q/k and v of different types (a fused group of mixed types);
# the K-quant kernels run through the same tq_linear calls (test_quant_gemv.py covers them)
TYPES = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_1",
         "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q5_0", "lm_head": "Q8_0"}  # fmt: skip


def _two_sequences(ex, steps: int) -> list[torch.Tensor]:
    """Sequence 7 (slot 0) prefilled, then sequence 9 (slot 1) prefilled and decoded `steps`
    greedy tokens: its float32 logits per step."""
    ex.run(Step((StepSequence(7, (5, 2, 6), 0),)))
    seq, pos, out = [3, 1, 4, 1, 5], 0, []
    for _ in range(steps):
        logits = ex.run(Step((StepSequence(9, tuple(seq[pos:]), pos),))).logits[0]
        pos = len(seq)
        seq.append(int(logits.argmax()))
        out.append(logits.float())
    return out


def _same_as_per_layer(model, monkeypatch, steps: int = 6) -> None:
    calls = []
    real = decode_model.run
    monkeypatch.setattr(decode_model, "run", lambda *a: calls.append(real(*a)) or calls[-1])
    got = _two_sequences(LocalExecutor(copy.deepcopy(model), max_batch=2, max_seq_len=64), steps)
    assert sum(c is not None for c in calls) == steps - 1  # every decode step, in one call
    monkeypatch.setattr(decode_model, "run", lambda *a: None)
    per_layer = []
    real_layer = decode_layer.run
    monkeypatch.setattr(decode_layer, "run", lambda *a: per_layer.append(1) or real_layer(*a))
    want = _two_sequences(LocalExecutor(model, max_batch=2, max_seq_len=64), steps)
    assert len(per_layer) == (steps - 1) * model.config.num_hidden_layers
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_one_call_decode_equals_the_two_call_layers_bit_for_bit(arch, dtype, monkeypatch):
    config = tiny_config(arch, mlp_bias=arch == "LlamaForCausalLM", num_hidden_layers=3)
    _same_as_per_layer(random_reference(config).to(dtype).eval(), monkeypatch)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_one_call_decode_over_quantized_projections_equals_the_two_call_layers(arch, monkeypatch):
    config = tiny_config(arch, mlp_bias=arch == "LlamaForCausalLM")
    model = quantize_model(random_reference(config), lambda n: TYPES[n.rsplit(".", 1)[-1]])
    _same_as_per_layer(model, monkeypatch)


def test_a_model_with_an_ineligible_layer_keeps_the_per_layer_path(monkeypatch):
    model = random_reference(tiny_config("Qwen3ForCausalLM")).eval()
    want = LocalExecutor(copy.deepcopy(model), max_batch=1, max_seq_len=32, kernels="torch")
    ex = LocalExecutor(model, max_batch=1, max_seq_len=32)
    layer0 = model.model.layers["0"]
    real = decode_layer.eligible
    monkeypatch.setattr(
        decode_layer, "eligible", lambda la, h, c: la is not layer0 and real(la, h, c)
    )
    ids, pos = [3, 1, 4], 0
    for _ in range(4):  # a prefill, then 3 one-token steps
        step = Step((StepSequence(0, tuple(ids[pos:]), pos),))
        a, b = ex.run(step).logits[0], want.run(step).logits[0]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        pos = len(ids)
        ids.append(int(a.argmax()))
    assert model.__dict__["_decode_plan"] is False  # looked at once, then the per-layer path
