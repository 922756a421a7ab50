"""Gemma 3 across real processes on loopback, against the single node in float32: a random-weight
`Gemma3ForCausalLM` saved by transformers (7 layers: local 0-4 and 6, global 5; MQA with one kv
head; a window of 8 that prompts of 7-10 tokens and 32 new ones cross in prefill and in decode;
local and linearly scaled global rope; sandwich norms) at TP=2 and TP=3 (the one kv head
replicated on every rank, its 4 query heads split 2/2 and 2/1/1), a pipeline of two stages and a
(TP=2, TP=1) grid gives the single node's greedy ids for 32 tokens at batch 1 and 3 and its first
logits within 1e-4; the single node's batch-1 ids are transformers' own."""

import pytest
import torch
import transformers
from family_support import (
    assert_pipeline_and_grid_match,
    assert_single_node,
    tp_groups,
    transformers_reference,
)

LAYOUTS = {"tp2": (2, {}), "tp3": (3, {})}


def hf_model() -> transformers.Gemma3ForCausalLM:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, max_position_embeddings=256,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        },
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(29)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # spread transformers' std-0.02 init so logits are not ties
        for p in hf.parameters():
            p.normal_(0, 0.25) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.1)
    return hf


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(model dir, single-node greedy at batch 1 and 3)."""
    d = tmp_path_factory.mktemp("gemma3")
    return d, transformers_reference(hf_model(), d)


def test_tp2_and_tp3_with_the_one_kv_head_replicated_match_single_node(gemma):
    d, expected = gemma
    with tp_groups(d, LAYOUTS) as groups:
        for name, ex in groups.items():
            shards = [r["shard"] for r in ex.describe()["ranks"]]
            assert all(s["kv_heads"] == [0, 1] for s in shards), name  # replicated
            assert_single_node(ex, expected)


def test_a_pipeline_and_a_grid_match_single_node(gemma):
    assert_pipeline_and_grid_match(gemma[0], gemma[1], cut=3, layers=7)
