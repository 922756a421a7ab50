import pytest
from tp_support import ModelExecutor, StateDictReader, greedy, random_reference, tiny_config

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.executor import Step, StepSequence
from tandem.engine.runner import ShardRunner, StepOrderError
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.worker import BroadcastSource, serve
from tandem.parallel.plan import plan_for_config
from tandem.parallel.shard_load import load_shard
from tandem.parallel.transform import shard_transformer

PROMPTS = [[5, 17, 33, 2, 8], [40, 41], [9, 9, 9, 1, 2, 3, 4, 70]]


def _tp_greedy(config, ref, n, prompts, n_new, weights=None):
    plan = plan_for_config(config, n, weights)
    state = ref.state_dict()

    def body(comm):
        model = shard_transformer(config, plan, comm)
        load_shard(model, StateDictReader(state), plan, comm.rank)
        runner = ShardRunner(model, max_batch=4, max_seq_len=64)
        if comm.rank != 0:
            return serve(runner, BroadcastSource(comm))
        ex = TPExecutor(runner, comm, config.vocab_size)
        try:
            return greedy(ex, prompts, n_new)
        finally:
            ex.close()

    return run_ranks(ReferenceCommunicator.group(n), body)


@pytest.mark.parametrize("n,weights,batch", [(2, None, 1), (3, None, 3), (2, (2.0, 1.0), 3)])
def test_tp_executor_matches_single_device_greedy_in_process(n, weights, batch):
    config = tiny_config()
    ref = random_reference(config)
    prompts = PROMPTS[:batch]
    expected, first = greedy(ModelExecutor(ref), prompts, 32)
    results = _tp_greedy(config, ref, n, prompts, 32, weights)
    got, got_first = results[0]
    assert got == expected
    assert (got_first - first).abs().max().item() < 1e-4
    assert results[1] == 32  # the worker ran every step, then stopped


def test_step_out_of_order_is_refused():
    runner = ShardRunner(random_reference(tiny_config()), max_batch=2, max_seq_len=16)
    runner.forward(Step((StepSequence(1, (3, 4), 0),)))
    with pytest.raises(StepOrderError):
        runner.forward(Step((StepSequence(1, (5,), 7),)))
    runner.release([1])
    assert runner.forward(Step((StepSequence(1, (5,), 0),))).shape == (1, 96)
