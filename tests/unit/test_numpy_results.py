"""The head over an executor whose results hold numpy arrays (as a torch-free executor's do): the
scheduler and the generation loop give the same tokens as over the same values in torch tensors."""

import numpy as np
import pytest
from _serving_doubles import HistoryExecutor, PipelineHistoryExecutor

from tandem.engine.executor import Step, StepResult, StepResultError, StepSequence
from tandem.engine.generate import generate
from tandem.engine.sampling_params import SamplingParams, make_generator
from tandem.engine.scheduler import Request, Scheduler

PROMPTS = [[1, 2, 3], [9, 8, 7, 6], [4]]
GREEDY = dict(max_tokens=6, temperature=0.0)
SAMPLED = dict(max_tokens=6, temperature=0.9, top_k=20, top_p=0.95, seed=11)


def test_a_numpy_step_result_is_checked_like_a_torch_one() -> None:
    with pytest.raises(StepResultError):
        StepResult(token_ids=np.zeros(2, dtype=np.float32))  # float ids
    with pytest.raises(StepResultError):
        StepResult(logits=np.zeros(4, dtype=np.float32))  # not (B, vocab)
    with pytest.raises(StepResultError):
        StepResult(token_ids=np.zeros((2, 1), dtype=np.int64))  # not (B,)
    logits = np.array([[0.0, 5.0, 1.0], [9.0, 0.0, 9.0]], dtype=np.float32)
    by_logits, by_ids = StepResult(logits=logits), StepResult(token_ids=np.array([1, 0]))
    g, greedy = make_generator(0), SamplingParams(temperature=0.0)
    assert [by_logits.pick(r, greedy, g) for r in range(2)] == [1, 0]  # a tie: the lower id
    assert [by_ids.pick(r, greedy, g) for r in range(2)] == [1, 0]
    assert by_logits.ids().tolist() == by_ids.ids().tolist() == [1, 0]
    assert len(by_logits) == len(by_ids) == 2


def test_the_executor_double_returns_numpy_when_asked() -> None:
    step = Step((StepSequence(0, (1, 2), 0),))
    out = HistoryExecutor(numpy=True).run(step)
    assert isinstance(out.logits, np.ndarray) and out.logits.dtype == np.float32
    ids = HistoryExecutor(numpy=True).run(Step(step.sequences, greedy=True)).token_ids
    assert isinstance(ids, np.ndarray) and ids.dtype.kind == "i"


def _schedule(executor, params: dict) -> list[list[int]]:
    sched = Scheduler(executor)
    outs: list[list[int]] = []
    reasons: list[str] = []
    for p in PROMPTS:
        toks: list[int] = []
        outs.append(toks)
        sched.submit(Request(list(p), SamplingParams(**params), toks.append, _reason(reasons)))
    while sched.step():
        pass
    assert reasons == ["length"] * len(PROMPTS)
    return outs


def _reason(reasons: list[str]):
    def on_finish(reason, error):
        assert error is None, error
        reasons.append(reason)

    return on_finish


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_scheduler_over_numpy_results_matches_torch_results(params: dict) -> None:
    via_numpy = _schedule(HistoryExecutor(numpy=True), params)
    assert via_numpy == _schedule(HistoryExecutor(), params)
    assert all(len(t) == 6 for t in via_numpy)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_generate_over_numpy_results_matches_torch_results(params: dict) -> None:
    p = SamplingParams(**params)
    via_numpy = generate(HistoryExecutor(numpy=True), PROMPTS, p)
    via_torch = generate(HistoryExecutor(), PROMPTS, p)
    assert [r.token_ids for r in via_numpy] == [r.token_ids for r in via_torch]
    piped = generate(PipelineHistoryExecutor(num_stages=2, numpy=True), PROMPTS, p, groups=2)
    assert [r.token_ids for r in piped] == [r.token_ids for r in via_torch]
