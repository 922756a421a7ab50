"""Each fast module (`tandem.kernels.modules`) computes what the reference module it replaces
computes, and the reference model itself never takes a native kernel."""

import copy

import pytest
import torch
from tp_support import greedy_steps, random_reference, tiny_config

from tandem.engine.executor import Step, StepSequence
from tandem.engine.local import LocalExecutor
from tandem.kernels import native
from tandem.kernels.fast_deltanet import FastGatedDeltaNet
from tandem.kernels.modules import FAST, swap_fast_modules
from tandem.models.presets import get_preset

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_model_equals_reference_within_float32_rounding(arch):
    ref_model = random_reference(tiny_config(arch))
    ref = LocalExecutor(copy.deepcopy(ref_model), max_batch=1, max_seq_len=32, kernels="torch")
    fast = LocalExecutor(ref_model, max_batch=1, max_seq_len=32)
    assert all(type(m) not in FAST for m in fast.model.modules())  # every module swapped
    steps = zip(greedy_steps(ref, [3, 1, 4, 1, 5], 8), greedy_steps(fast, [3, 1, 4, 1, 5], 8))
    for (id_ref, a), (id_fast, b) in steps:
        assert id_fast == id_ref
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


# batched prefills, batched and single decodes, a row restarting at 0 with one token (its slot
# cleared before the native call) beside a row decoding, and a decode after it
HYBRID_STEPS = [
    Step((StepSequence(0, (5, 17, 42, 99, 3), 0), StepSequence(1, (30, 1, 2), 0))),
    Step((StepSequence(0, (9,), 5), StepSequence(1, (4,), 3))),
    Step((StepSequence(1, (6,), 4),)),
    Step((StepSequence(0, (12,), 6), StepSequence(2, (7,), 0))),
    Step((StepSequence(1, (8,), 0), StepSequence(2, (13,), 1))),  # slot 1 from 0 again
    Step((StepSequence(0, (1,), 7), StepSequence(1, (2,), 1), StepSequence(2, (3,), 2))),
]


@pytest.mark.skipif(not native.available(), reason=native.why())
@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35-moe"])
def test_the_hybrid_decodes_on_the_native_mixer_within_float32_rounding(preset, monkeypatch):
    """Every decode step of a DeltaNet layer takes `FastGatedDeltaNet`'s native mixer (one call
    per row), and each step's logits stay within float32 rounding of the reference's."""
    ref_model = random_reference(get_preset(preset).config, std=0.1)
    ref = LocalExecutor(copy.deepcopy(ref_model), max_batch=3, max_seq_len=32, kernels="torch")
    fast = LocalExecutor(ref_model, max_batch=3, max_seq_len=32)
    nets = [m for m in fast.model.modules() if isinstance(m, FastGatedDeltaNet)]
    assert nets
    calls = []
    mix = native.deltanet_mix
    monkeypatch.setattr(native, "deltanet_mix", lambda *a: calls.append(1) or mix(*a))
    for i, step in enumerate(HYBRID_STEPS):
        calls.clear()
        want, got = ref.run(step).logits.float(), fast.run(step).logits.float()
        decode = all(len(s.token_ids) == 1 for s in step.sequences)
        assert len(calls) == (len(nets) * len(step.sequences) if decode else 0), i
        # every fast module's float32 sum order (the MoE block's too): measured up to 6e-5 on
        # logits up to 6.6, the same with the mixer on the reference form
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_kernels_torch_keeps_the_reference_classes():
    ex = LocalExecutor(
        random_reference(tiny_config()), max_batch=1, max_seq_len=16, kernels="torch"
    )
    assert {type(m) for m in ex.model.modules()} & set(FAST)
    assert not {type(m) for m in ex.model.modules()} & set(FAST.values())


def test_swap_is_idempotent_and_keeps_parameters():
    model = random_reference(tiny_config())
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    first = swap_fast_modules(model)
    assert first > 0 and swap_fast_modules(model) == 0
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


@pytest.mark.skipif(not native.available(), reason=native.why())
def test_reference_rmsnorm_never_calls_native(monkeypatch):
    model = random_reference(tiny_config())
    monkeypatch.setattr(native, "rmsnorm", lambda *a: pytest.fail("reference took native"))
    tokens = torch.tensor([[1, 2, 3]])
    model(tokens)  # the plain reference: no native call anywhere
