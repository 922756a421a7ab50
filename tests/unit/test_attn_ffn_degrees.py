"""Separate attention and MLP degrees (`TPPlan.attn_ranks`): attention over the first A ranks of a
group, the MLP rows and vocabulary over all N; equal to the single-device reference (in process
here; across real processes in tests/distributed/test_attn_ffn_processes.py)."""

import pytest
from tp_support import ModelExecutor, StateDictReader, greedy, random_reference, tiny_config

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.runner import ShardRunner
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.worker import BroadcastSource, serve
from tandem.parallel.absent import AbsentAttention
from tandem.parallel.apportion import Span
from tandem.parallel.plan import TPPlanError, make_tp_plan, plan_for_config
from tandem.parallel.shard_load import load_shard
from tandem.parallel.transform import shard_transformer

PROMPTS = [[5, 17, 33, 2, 8], [40, 41], [9, 9, 9, 1, 2, 3, 4, 70]]


def test_attention_on_two_of_three_ranks_leaves_the_third_empty_heads_and_its_mlp_rows():
    plan = make_tp_plan(
        world_size=3, n_heads=8, n_kv_heads=4, head_dim=16, intermediate_size=192,
        vocab_size=96, attn_ranks=2,
    )  # fmt: skip
    assert plan.kv_heads == (Span(0, 2), Span(2, 4), Span(4, 4))
    assert [plan.q_heads(r) for r in range(3)] == [Span(0, 4), Span(4, 8), Span(8, 8)]
    assert plan.intermediate == (Span(0, 64), Span(64, 128), Span(128, 192))
    assert [plan.holds_attention(r) for r in range(3)] == [True, True, False]
    assert plan.kv_rows(2).size == 0 and plan.o_columns(2).size == 0


@pytest.mark.parametrize("a", [0, 4])
def test_attention_degree_outside_one_to_n_is_refused(a):
    with pytest.raises(TPPlanError, match="attention on"):
        make_tp_plan(
            world_size=3, n_heads=8, n_kv_heads=4, head_dim=16, intermediate_size=192,
            vocab_size=96, attn_ranks=a,
        )  # fmt: skip


def _tp_greedy(config, ref, n, a, prompts, n_new):
    plan = plan_for_config(config, n, attn_ranks=a)
    state = ref.state_dict()

    def body(comm):
        model = shard_transformer(config, plan, comm)
        load_shard(model, StateDictReader(state), plan, comm.rank)
        runner = ShardRunner(model, max_batch=4, max_seq_len=64)
        absent = isinstance(model.model.layers["0"].self_attn, AbsentAttention)
        assert absent == (comm.rank >= a)
        assert (runner.cache.nbytes() == 0) == absent  # no heads, no KV cache
        if comm.rank != 0:
            return serve(runner, BroadcastSource(comm))
        ex = TPExecutor(runner, comm, config.vocab_size)
        try:
            return greedy(ex, prompts, n_new)
        finally:
            ex.close()

    return run_ranks(ReferenceCommunicator.group(n), body)


@pytest.mark.parametrize("n,a,batch", [(3, 2, 3)])  # the rest across processes
def test_attention_on_a_ranks_and_mlp_on_n_equals_single_device(n, a, batch):
    config = tiny_config(intermediate_size=192)
    ref = random_reference(config)
    prompts = PROMPTS[:batch]
    expected, first = greedy(ModelExecutor(ref), prompts, 32)
    results = _tp_greedy(config, ref, n, a, prompts, 32)
    got, got_first = results[0]
    assert got == expected
    assert (got_first - first).abs().max().item() < 1e-4
