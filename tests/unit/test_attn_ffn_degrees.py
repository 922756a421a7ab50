"""Separate attention and MLP degrees (`TPPlan.attn_ranks`): attention over the first A ranks of a
group, the MLP rows and vocabulary over all N; equal to the single-device reference (in process
here; across real processes in tests/distributed/test_attn_ffn_processes.py)."""

import pytest
from tp_support import ModelExecutor, greedy, random_reference, tiny_config, tp_greedy_in_process

from tandem.parallel.absent import AbsentAttention
from tandem.parallel.apportion import Span
from tandem.parallel.plan import TPPlanError, make_tp_plan

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


def _absent_iff_outside(a):
    def check(rank, model, runner):
        absent = isinstance(model.model.layers["0"].self_attn, AbsentAttention)
        assert absent == (rank >= a)
        assert (runner.cache.nbytes() == 0) == absent  # no heads, no KV cache

    return check


@pytest.mark.parametrize("n,a,batch", [(3, 2, 3)])  # the rest across processes
def test_attention_on_a_ranks_and_mlp_on_n_equals_single_device(n, a, batch):
    config = tiny_config(intermediate_size=192)
    ref = random_reference(config)
    prompts = PROMPTS[:batch]
    expected, first = greedy(ModelExecutor(ref), prompts, 32)
    results = tp_greedy_in_process(
        config, ref, n, prompts, 32, attn_ranks=a, check=_absent_iff_outside(a)
    )
    got, got_first = results[0]
    assert got == expected
    assert (got_first - first).abs().max().item() < 1e-4
