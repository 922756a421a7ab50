"""The gated delta rule's two forms equal each other, and a DeltaNet layer's state is the
sequence's alone: the chunked prefill equals the token-by-token recurrence (output and final state,
across several chunks and from a nonzero state); padded tokens leave a row's state as its last real
token left it; a step in pieces equals the step whole; a hybrid sequence refuses a rewind."""

import dataclasses

import numpy as np
import pytest
import torch

from tandem.engine.executor import Step, StepSequence
from tandem.engine.sequences import RecurrentRewindError, SequenceCache
from tandem.models.delta_rule import chunked_delta_rule, recurrent_delta_rule
from tandem.models.kv_cache import KVCache
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset, random_weights


def _inputs(B: int, H: int, T: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g)
    decay = -torch.rand(B, H, T, generator=g) * 3
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_chunked_delta_rule_equals_the_recurrence(T) -> None:
    args = _inputs(2, 3, T, 8, 12, seed=T)
    o_rec, s_rec = recurrent_delta_rule(*args)
    for chunk in (16, 64):
        o, s = chunked_delta_rule(*args, chunk=chunk)
        torch.testing.assert_close(o, o_rec, atol=2e-5, rtol=0)
        torch.testing.assert_close(s, s_rec, atol=2e-5, rtol=0)


def test_a_token_without_decay_or_rate_leaves_the_state_alone() -> None:
    q, k, v, decay, beta, state = _inputs(1, 2, 6, 4, 5, seed=1)
    decay[..., 3:], beta[..., 3:] = 0.0, 0.0
    _, s_all = chunked_delta_rule(q, k, v, decay, beta, state)
    _, s_three = recurrent_delta_rule(q[:, :, :3], k[:, :, :3], v[:, :, :3], decay[..., :3],
                                      beta[..., :3], state)  # fmt: skip
    torch.testing.assert_close(s_all, s_three, atol=1e-6, rtol=0)


def _model(name: str) -> Transformer:
    c = get_preset(name).config
    m = Transformer(c)
    m.load_state_dict(random_weights(c, 5, torch.float32))
    return m.eval()


@pytest.mark.parametrize("name", ["tiny-qwen35", "tiny-qwen35-moe"])
@torch.inference_mode()
def test_a_ragged_batch_in_pieces_equals_each_sequence_whole(name) -> None:
    """Rows of 9, 2 and 5 tokens prefilled together (padded), then 3, 1, 4 more: each row's
    last logits equal that sequence run alone in one step."""
    m = _model(name)
    first = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 7], [42, 43, 44, 45, 46]]
    more = [[5, 6, 7], [8], [9, 10, 11, 12]]
    cache = KVCache.for_model(m, 3, 64)
    ctx = m.context([0, 0, 0], [9, 2, 5], cache, [0, 1, 2])
    m.forward_layers(m.embed(torch.tensor([r + [0] * (9 - len(r)) for r in first])), ctx)
    starts = [len(r) for r in first]
    ctx = m.context(starts, [3, 1, 4], cache, [0, 1, 2])
    h = m.forward_layers(m.embed(torch.tensor([r + [0] * (4 - len(r)) for r in more])), ctx)
    got = m.head(m.last_hidden(h, ctx))[:, 0]
    for b in range(3):
        whole = m(torch.tensor([first[b] + more[b]]))[0, -1]
        torch.testing.assert_close(got[b], whole, atol=1e-5, rtol=0)


def test_a_hybrid_sequence_continues_or_restarts_but_never_rewinds() -> None:
    cfg = get_preset("tiny-qwen35").config
    seqs = SequenceCache(2, 64, recurrent=cfg.hybrid)
    seqs.advance(Step((StepSequence(0, (1, 2, 3, 4), 0),)))
    seqs.check(Step((StepSequence(0, (5,), 4),)))  # continues
    seqs.check(Step((StepSequence(0, (1, 2), 0),)))  # restarts: a full re-prefill
    with pytest.raises(RecurrentRewindError, match="continues at 4 or restarts at 0"):
        seqs.check(Step((StepSequence(0, (3, 9), 2),)))
    dense = SequenceCache(2, 64, recurrent=dataclasses.replace(cfg, deltanet=None).hybrid)
    dense.advance(Step((StepSequence(0, (1, 2, 3, 4), 0),)))
    dense.check(Step((StepSequence(0, (3, 9), 2),)))  # an attention-only model rewinds


def test_a_deltanet_layer_holds_a_fixed_state_instead_of_keys_and_values() -> None:
    """The cache of tiny-qwen35 (3 DeltaNet layers, 1 attention) holds keys and values for the
    attention layer only; each DeltaNet layer a conv window and a dk x dv matrix per v head."""
    m = _model("tiny-qwen35")
    c = m.config
    s = c.deltanet
    cache = KVCache.for_model(m, n_slots=2, max_seq_len=100)
    assert sorted(cache.k) == [3] and sorted(cache.conv) == sorted(cache.ssm) == [0, 1, 2]
    kv = 2 * c.num_key_value_heads * 100 * c.head_dim * 4
    conv, matrix = s.state_elements()
    assert conv == (2 * 2 * 8 + 4 * 12) * 3 and matrix == 4 * 8 * 12
    assert cache.bytes_per_sequence() == {"kv": kv, "state": 3 * (conv + matrix) * 4}
    assert cache.nbytes() == 2 * (kv + 3 * (conv + matrix) * 4)


def test_the_tp_plan_splits_deltanet_heads_by_weight_and_refuses_more_ranks_than_heads() -> None:
    """tiny-qwen35 (2 q/k heads serving 4 v heads of 12, 8 wide): TP=2 gives each rank one q/k
    head, its two v heads, and rows q [8h, 8h+8), k 16 + that, v 32 + [24h, 24h+24); TP=3 has
    a rank with no q/k head and is refused by name; attention on fewer ranks too."""
    from tandem.parallel.plan import DegeneratePlanError, TPPlanError, plan_for_config

    c = get_preset("tiny-qwen35").config
    plan = plan_for_config(c, 2)
    assert [(s.start, s.end) for s in plan.linear_k_heads] == [(0, 1), (1, 2)]
    assert [(s.start, s.end) for s in plan.linear_qkv_rows(1)] == [(8, 16), (24, 32), (56, 80)]
    assert (plan.linear_v_heads(1).start, plan.linear_v_heads(1).end) == (2, 4)
    assert (plan.q_proj_rows(1).start, plan.q_proj_rows(1).end) == (64, 128)  # 2 hd a head
    with pytest.raises(DegeneratePlanError, match="linear_num_key_heads"):
        plan_for_config(c, 3)
    with pytest.raises(TPPlanError, match="attention on every rank"):
        plan_for_config(c, 2, attn_ranks=1)


@pytest.mark.parametrize(("hk", "hv", "tp"), [(2, 4, 2), (3, 6, 2), (3, 6, 3), (4, 12, 3)])
def test_a_tiled_files_runs_give_each_rank_its_heads_tiled_over_its_own(hk, hv, tp) -> None:
    """A qwen35 GGUF's v heads tiled (place t Hk + g: group g's head t): rank r's runs of the
    stored rows (in_proj_qkv's v part, in_proj_z, in_proj_a, out_proj's columns) are the rows of
    the v heads its q/k heads serve, tiled over its own q/k heads, which is how the model reads a
    tiled shard (v head j served by q/k head j % its Hk)."""
    from tandem.models.families.qwen3_5_gguf import _tiled
    from tandem.parallel.plan import plan_for_config
    from tandem.parallel.shard_load import linear_ranges

    c = get_preset("tiny-qwen35").config
    spec = dataclasses.replace(c.deltanet, num_key_heads=hk, num_value_heads=hv, v_tiled=True)
    c = dataclasses.replace(c, deltanet=spec)
    dk, dv, r = spec.key_head_dim, spec.value_head_dim, hv // hk
    plan = plan_for_config(c, tp)
    assert plan.linear_v_tiled
    qkv = torch.arange(2 * hk * dk + hv * dv, dtype=torch.float32)[:, None]  # (C, 1): row ids
    stored = torch.cat([qkv[: 2 * hk * dk], _tiled(qkv[2 * hk * dk :], 0, hk, r, dv)])
    z = torch.arange(hv * dv, dtype=torch.float32)[:, None]
    a = torch.arange(hv, dtype=torch.float32)[:, None]
    out = torch.arange(hv * dv, dtype=torch.float32)[None, :]  # (D, Hv dv): columns
    tensors = {"in_proj_qkv.weight": (qkv, stored), "in_proj_z.weight": (z, _tiled(z, 0, hk, r, dv)),
               "in_proj_a.weight": (a, _tiled(a, 0, hk, r, 1)),
               "out_proj.weight": (out, _tiled(out, 1, hk, r, dv))}  # fmt: skip
    for rank in range(tp):
        k = plan.linear_k_heads[rank]
        v = plan.linear_v_heads(rank)
        n = k.size
        for leaf, (grouped, tiled) in tensors.items():
            runs = linear_ranges(f"model.layers.0.linear_attn.{leaf}", plan, rank)
            got = torch.cat([tiled.narrow(d, s, e - s) for d, s, e in runs], dim=runs[0][0])
            if leaf == "in_proj_qkv.weight":  # q and k rows as they are, then the v heads
                qk = [grouped[s.start : s.end] for s in plan.linear_qkv_rows(rank)[:2]]
                mine = grouped[2 * hk * dk + v.start * dv : 2 * hk * dk + v.end * dv]
                want = torch.cat([*qk, _tiled(mine, 0, n, r, dv)])
            else:
                w = dv if leaf != "in_proj_a.weight" else 1
                dim = 1 if leaf == "out_proj.weight" else 0
                mine = grouped.narrow(dim, v.start * w, v.size * w)
                want = _tiled(mine, dim, n, r, w)
            assert torch.equal(got, want), (rank, leaf)


@torch.inference_mode()
def test_a_replay_from_position_0_discards_the_held_state() -> None:
    """A replay (after a node loss) re-prefills a sequence from position 0 on an executor that may
    still hold it: the DeltaNet state starts from zeros again, so the logits equal a fresh run's."""
    from tandem.engine.local import LocalExecutor

    held = LocalExecutor(_model("tiny-qwen35"), max_batch=2, max_seq_len=64, kernels="torch")
    held.run(Step((StepSequence(0, (1, 2, 3, 4, 5), 0),)))
    held.run(Step((StepSequence(0, (6,), 5),)))
    history = (1, 2, 3, 4, 5, 6, 7, 8)
    replayed = held.run(Step((StepSequence(0, history, 0),))).logits[0]
    fresh = LocalExecutor(_model("tiny-qwen35"), max_batch=2, max_seq_len=64, kernels="torch")
    torch.testing.assert_close(replayed, fresh.run(Step((StepSequence(0, history, 0),))).logits[0])


@pytest.mark.parametrize(
    ("qtype", "shape", "out_type", "align"),
    [("Q8_0", dict(value_head_dim=32), "Q8_0", 1),
     ("K_MIX", dict(num_key_heads=4, num_value_heads=8, value_head_dim=128), "Q4_K", 2)],
)  # fmt: skip
def test_a_quantized_qwen35_gguf_plans_under_tp_and_its_out_proj_runs_are_whole_blocks(
    tmp_path, qtype, shape, out_type, align
) -> None:
    """tiny-qwen35 as a qwen35 GGUF: in BF16 the TP=2 plan reads its v heads tiled; in Q8_0
    (v heads of 32) and in the Q4_K_M mix (hidden 256, v heads of 128, out_proj Q4_K: blocks of
    256, two v heads) its DeltaNet projections are blocks, planned at TP=2 in units of 1 and 2
    q/k heads, and each rank's out_proj column runs, read as blocks and concatenated along each
    row's bytes, dequantize (gguf-py) to exactly those columns of the whole tensor."""
    import gguf

    from tandem.loaders.gguf.model_file import GGUFModel
    from tandem.loaders.gguf.writer import write_model_dir_gguf
    from tandem.loaders.make import make_model_dir
    from tandem.parallel.plan import contraction_blocks, plan_for_source
    from tandem.parallel.shard_load import linear_ranges

    c = get_preset("tiny-qwen35").config
    c = dataclasses.replace(c, deltanet=dataclasses.replace(c.deltanet, **shape))
    if qtype == "K_MIX":  # rows of whole 256-element blocks
        c = dataclasses.replace(c, hidden_size=256, intermediate_size=512)
    make_model_dir(tmp_path / "m", "tiny-qwen35", seed=0, config=c)
    files = {q: write_model_dir_gguf(tmp_path / "m", tmp_path / f"{q}.gguf", q)[0]
             for q in ("BF16", qtype)}  # fmt: skip
    plan = plan_for_source(GGUFModel(files["BF16"]), 2)
    hk = c.deltanet.num_key_heads
    assert plan.linear_v_tiled and plan.linear_align == 1
    assert [(s.start, s.end) for s in plan.linear_v_spans(1)] == [
        (hk // 2, hk),
        (hk + hk // 2, 2 * hk),
    ]
    q = GGUFModel(files[qtype])
    name = "model.layers.0.linear_attn.out_proj.weight"
    t = gguf.GGMLQuantizationType[out_type]
    block = gguf.GGML_QUANT_SIZES[t][0]
    assert q.info(name).type_id == t and contraction_blocks(q)["linear_out_block"] == block
    assert q.info("model.layers.0.linear_attn.in_proj_qkv.weight").quantized
    plan = plan_for_source(q, 2)
    assert plan.linear_align == align and plan.linear_v_tiled
    whole = gguf.quants.dequantize(q.blocks(name).numpy(), t)
    for rank in range(2):
        runs = linear_ranges(name, plan, rank)
        assert [(d, s % block, e % block) for d, s, e in runs] == [(1, 0, 0)] * 2  # whole blocks
        mine = torch.cat([q.blocks(name, *r) for r in runs], dim=1)  # (rows, row bytes)
        got = gguf.quants.dequantize(mine.numpy(), t)
        want = np.concatenate([whole[:, s:e] for _, s, e in runs], axis=1)
        assert np.array_equal(got, want), rank


@pytest.mark.parametrize(
    ("hk", "hv", "dv", "block", "tp", "align"),
    [(3, 6, 32, 32, 3, 1), (4, 12, 128, 256, 2, 2), (16, 48, 128, 256, 3, 2),
     (6, 12, 64, 256, 2, 4), (3, 6, 12, 32, 2, 8), (3, 6, 128, 256, 2, 2), (2, 4, 128, 256, 2, 2)],
)  # fmt: skip
def test_deltanet_heads_are_cut_where_every_out_proj_run_is_whole_blocks(
    hk, hv, dv, block, tp, align
) -> None:
    """A quantized out_proj's contraction is cut on its blocks: the q/k heads go in units of
    `align` = B / gcd(B, dv) (tiled v heads), so every run edge (t Hk + a) dv is a multiple of
    B; where Hk is not a multiple of the unit, or there are fewer units than ranks, the plan is
    refused (DegeneratePlanError) rather than cutting a block. One node needs no cut."""
    from tandem.parallel.plan import DegeneratePlanError, plan_for_config
    from tandem.parallel.shard_load import linear_ranges

    c = get_preset("tiny-qwen35").config
    spec = dataclasses.replace(
        c.deltanet, num_key_heads=hk, num_value_heads=hv, value_head_dim=dv, v_tiled=True
    )
    c = dataclasses.replace(c, deltanet=spec)
    assert plan_for_config(c, 1, linear_out_block=block).linear_align == 1
    if hk % align or hk // align < tp:
        with pytest.raises(DegeneratePlanError, match="q/k heads"):
            plan_for_config(c, tp, linear_out_block=block)
        return
    plan = plan_for_config(c, tp, linear_out_block=block)
    assert plan.linear_align == align
    for rank in range(tp):
        runs = linear_ranges("model.layers.0.linear_attn.out_proj.weight", plan, rank)
        assert all(s % block == 0 and e % block == 0 for _, s, e in runs), (rank, runs)


def test_the_tp_transform_builds_deltanet_projections_over_blocks_and_refuses_a_quantized_conv():
    """A rank's DeltaNet projections stored block-quantized are built over blocks (the rank's
    rows; out_proj's columns); the conv, A, dt and the norm are sharded as floats, so one stored
    quantized is refused by name (TransformError), not loaded wrong."""
    from tandem.comm.solo import SoloCommunicator
    from tandem.models.quant.blocks import BY_NAME
    from tandem.models.quant.linear import QuantLinear
    from tandem.parallel.plan import plan_for_config
    from tandem.parallel.transform import TransformError, shard_transformer

    c = get_preset("tiny-qwen35").config
    plan, q8 = plan_for_config(c, 1), BY_NAME["Q8_0"].type_id
    p = "model.layers.0.linear_attn."
    qt = {p + "in_proj_qkv.weight": q8, p + "in_proj_z.weight": q8}
    net = shard_transformer(c, plan, SoloCommunicator(), qtypes=qt).model.layers["0"].linear_attn
    assert isinstance(net.in_proj_qkv.quant, QuantLinear) and net.in_proj_a.quant is None
    with pytest.raises(TransformError, match="conv1d.weight is block-quantized"):
        shard_transformer(c, plan, SoloCommunicator(), qtypes={p + "conv1d.weight": q8})
