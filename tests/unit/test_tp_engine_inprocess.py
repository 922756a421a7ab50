import pytest
from tp_support import (
    ModelExecutor,
    greedy,
    random_reference,
    tiny_config,
    tp_greedy_in_process,
)

from tandem.engine.executor import Step, StepSequence
from tandem.engine.runner import ShardRunner, StepOrderError

PROMPTS = [[5, 17, 33, 2, 8], [40, 41], [9, 9, 9, 1, 2, 3, 4, 70]]


@pytest.mark.parametrize("n,weights,batch", [(2, None, 1), (3, None, 3), (2, (2.0, 1.0), 3)])
def test_tp_executor_matches_single_device_greedy_in_process(n, weights, batch):
    config = tiny_config()
    ref = random_reference(config)
    prompts = PROMPTS[:batch]
    expected, first = greedy(ModelExecutor(ref), prompts, 32)
    results = tp_greedy_in_process(config, ref, n, prompts, 32, weights=weights)
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
