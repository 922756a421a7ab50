"""The cached, batched, padded path of the reference model equals its plain causal pass."""

import pytest
import torch

from tandem.config import ModelConfig
from tandem.models.context import BadStepError
from tandem.models.kv_cache import KVCache, SequenceTooLongError, SlotTable
from tandem.models.llama import Transformer


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        architecture="Qwen3ForCausalLM",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        qk_norm=True,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config()).eval()


@torch.inference_mode()
def test_batched_prefill_then_decode_with_different_lengths_equals_full_pass(model):
    torch.manual_seed(1)
    prompts = [torch.randint(0, 97, (n,)) for n in (5, 2, 7)]
    cache = KVCache.for_model(model, n_slots=6, max_seq_len=32)
    slots = [4, 0, 2]  # not consecutive: exercises the gather path
    T = max(len(p) for p in prompts)
    tokens = torch.zeros(3, T, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    ctx = model.context([0, 0, 0], [len(p) for p in prompts], cache, slots)
    h = model.forward_layers(model.embed(tokens), ctx)
    logits = model.head(model.last_hidden(h, ctx))[:, 0]
    seqs = [p.tolist() for p in prompts]
    for _ in range(4):
        for b, s in enumerate(seqs):
            ref = model(torch.tensor([s]))[0, -1]
            torch.testing.assert_close(logits[b], ref, atol=1e-5, rtol=0)
        nxt = logits.argmax(-1)
        starts = [len(s) for s in seqs]
        for b, s in enumerate(seqs):
            s.append(int(nxt[b]))
        ctx = model.context(starts, [1, 1, 1], cache, slots)
        logits = model(nxt[:, None], ctx)[:, 0]


@torch.inference_mode()
def test_pipeline_stages_over_global_layer_indices_compose_to_the_full_model(model):
    tokens = torch.randint(0, 97, (2, 6))
    first = Transformer(model.config, layer_range=(0, 1), with_head=False)
    last = Transformer(model.config, layer_range=(1, 3), with_embed=False)
    sd = model.state_dict()
    first.load_state_dict({k: v for k, v in sd.items() if k in first.state_dict()})
    last.load_state_dict({k: v for k, v in sd.items() if k in last.state_dict()})
    assert list(last.model.layers.keys()) == ["1", "2"]
    ctx = first.context([0, 0], [6, 6])
    out = last.head(last.forward_layers(first.forward_layers(first.embed(tokens), ctx), ctx))
    torch.testing.assert_close(out, model(tokens), atol=0, rtol=0)


def test_cache_is_sized_from_each_attention_local_head_count(model):
    m = Transformer(model.config, layer_range=(1, 3))
    for layer in m.model.layers.values():
        layer.self_attn.n_kv_heads = 1  # what a TP=2 transform sets
    cache = KVCache.for_model(m, n_slots=2, max_seq_len=16)
    assert sorted(cache.k) == [1, 2]
    assert cache.k[1].shape == (2, 1, 16, 8)


def test_step_past_the_cache_or_with_clashing_slots_is_refused(model):
    cache = KVCache.for_model(model, n_slots=2, max_seq_len=8)
    with pytest.raises(SequenceTooLongError):
        model.context([6], [3], cache, [0])
    with pytest.raises(BadStepError):
        model.context([0, 0], [1, 1], cache, [1, 1])


def test_slot_table_gives_lowest_free_slot_and_reuses_released_ones():
    t = SlotTable(2)
    assert (t.slot(10), t.slot(11), t.slot(10)) == (0, 1, 0)
    t.release(10)
    assert t.slot(12) == 0
