"""Each fast module (`tandem.kernels.modules`) computes what the reference module it replaces
computes, and the reference model itself never takes a native kernel."""

import copy

import pytest
import torch
from tp_support import greedy_steps, random_reference, tiny_config

from tandem.engine.local import LocalExecutor
from tandem.kernels import native
from tandem.kernels.modules import FAST, swap_fast_modules

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
