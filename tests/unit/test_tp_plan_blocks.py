"""Block-aware TP plans: row-parallel shard edges fall on the quantized weight's block boundaries,
and an o_proj whose head edges cannot, falls back to the stated gather split."""

import pytest

from tandem.parallel.plan import DegeneratePlanError, make_tp_plan

SMOLLM2 = dict(n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)
# a qwen3-like shape whose q-head edges are not multiples of 256 at TP=2 or TP=3
ODD_K = dict(n_heads=8, n_kv_heads=2, head_dim=96, intermediate_size=768, vocab_size=512)


def _ranges(shards):
    return [(s.start, s.end) for s in shards]


def test_smollm2_q4_1_tp2_keeps_head_edges_on_32_blocks():
    p = make_tp_plan(world_size=2, o_block=32, down_block=32, **SMOLLM2)
    assert p.o_split == "heads"
    assert _ranges(p.o_cols) == [(0, 384), (384, 576)]
    assert [p.o_columns(r) for r in range(2)] == [p.q_rows(r) for r in range(2)]
    assert _ranges(p.kv_heads) == [(0, 2), (2, 3)]
    assert p.mlp_align == 64
    assert _ranges(p.intermediate) == [(0, 768), (768, 1536)]


def test_smollm2_q4_1_weighted_2_1_and_tp3():
    w = make_tp_plan(world_size=2, weights=(2, 1), o_block=32, down_block=32, **SMOLLM2)
    assert w.o_split == "heads" and _ranges(w.o_cols) == [(0, 384), (384, 576)]
    assert _ranges(w.intermediate) == [(0, 1024), (1024, 1536)]
    t3 = make_tp_plan(world_size=3, o_block=32, down_block=32, **SMOLLM2)
    assert t3.o_split == "heads"
    assert _ranges(t3.o_cols) == [(0, 192), (192, 384), (384, 576)]
    assert _ranges(t3.intermediate) == [(0, 512), (512, 1024), (1024, 1536)]


def test_k_quant_o_proj_off_block_head_edges_fall_back_to_gather_tp2():
    p = make_tp_plan(world_size=2, o_block=256, down_block=256, **ODD_K)
    assert _ranges([p.q_rows(r) for r in range(2)]) == [(0, 384), (384, 768)]
    assert p.o_split == "gather"
    assert _ranges(p.o_cols) == [(0, 512), (512, 768)]
    assert p.mlp_align == 256
    assert _ranges(p.intermediate) == [(0, 512), (512, 768)]


def test_k_quant_o_proj_fallback_tp3_with_replicated_kv_heads():
    p = make_tp_plan(world_size=3, o_block=256, down_block=256, **ODD_K)
    assert _ranges([p.q_rows(r) for r in range(3)]) == [(0, 192), (192, 384), (384, 768)]
    assert p.o_split == "gather"
    assert _ranges(p.o_cols) == [(0, 256), (256, 512), (512, 768)]
    assert _ranges(p.intermediate) == [(0, 256), (256, 512), (512, 768)]


def test_k_quant_head_edges_on_256_keep_the_head_split():
    p = make_tp_plan(
        world_size=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=128,
        intermediate_size=512,
        vocab_size=256,
        o_block=256,
        down_block=256,
    )
    assert p.o_split == "heads" and _ranges(p.o_cols) == [(0, 256), (256, 512)]


def test_dense_weights_keep_the_old_plan():
    dense = make_tp_plan(world_size=2, **ODD_K)
    assert dense.o_split == "heads" and dense.mlp_align == 64
    assert _ranges(dense.intermediate) == [(0, 384), (384, 768)]


def test_too_few_blocks_for_the_ranks_is_a_typed_error():
    with pytest.raises(DegeneratePlanError, match="o_proj contraction"):
        make_tp_plan(world_size=4, o_block=256, down_block=32, **ODD_K)
    with pytest.raises(DegeneratePlanError, match="MLP intermediate"):
        make_tp_plan(world_size=4, o_block=32, down_block=256, **ODD_K)
