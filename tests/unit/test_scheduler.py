"""The scheduler over a history-checking executor double: positions, batching, sampling, failure."""

import threading

import pytest
from _serving_doubles import HistoryExecutor

from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.engine.scheduler import EngineUnavailable, Request, RequestRejected, Scheduler


def _collect(prompt, **params):
    out: dict = {"tokens": [], "reason": None}
    done = threading.Event()

    def on_finish(reason, err):
        out["reason"], out["error"] = reason, err
        done.set()

    req = Request(list(prompt), SamplingParams(**params), out["tokens"].append, on_finish)
    return req, out, done


def _run_alone(prompt, **params):
    ex = HistoryExecutor()
    sched = Scheduler(ex)
    req, out, _ = _collect(prompt, **params)
    sched.submit(req)
    while sched.step():
        pass
    return out


def test_requests_arriving_mid_generation_join_the_running_batch():
    ex = HistoryExecutor()
    sched = Scheduler(ex)
    a, out_a, _ = _collect([1, 2, 3], max_tokens=6, temperature=0)
    sched.submit(a)
    sched.step()  # a's prefill
    sched.step()  # a decodes alone
    b, out_b, _ = _collect([9, 8, 7, 6], max_tokens=3, temperature=0)
    sched.submit(b)
    sched.step()
    mixed = ex.steps[-1].sequences
    assert len(mixed) == 2
    assert len(mixed[0].token_ids) == 1 and mixed[1].token_ids == (9, 8, 7, 6)
    while sched.step():
        pass
    assert out_a["reason"] == "length" and len(out_a["tokens"]) == 6
    assert out_b["reason"] == "length" and len(out_b["tokens"]) == 3
    assert out_a["tokens"] == _run_alone([1, 2, 3], max_tokens=6, temperature=0)["tokens"]
    assert out_b["tokens"] == _run_alone([9, 8, 7, 6], max_tokens=3, temperature=0)["tokens"]


def test_seeded_sampling_is_independent_of_batch_composition():
    ex = HistoryExecutor(max_batch=3)
    sched = Scheduler(ex)
    params = dict(max_tokens=8, temperature=0.9, top_p=0.95, top_k=20, seed=1234)
    outs = []
    for i in range(5):
        req, out, _ = _collect([i + 1, 5, 3], **params)
        sched.submit(req)
        outs.append(out)
    while sched.step():
        pass
    assert max(len(s.sequences) for s in ex.steps) == 3
    for i, out in enumerate(outs):
        assert out["tokens"] == _run_alone([i + 1, 5, 3], **params)["tokens"]
    assert sorted(ex.released) == list(range(5))


def test_long_prompts_are_prefilled_in_chunks_within_the_budget():
    ex = HistoryExecutor()
    sched = Scheduler(ex, prefill_budget=3)
    req, out, _ = _collect(list(range(1, 9)), max_tokens=2, temperature=0)
    sched.submit(req)
    while sched.step():
        pass
    starts = [(s.sequences[0].start_pos, len(s.sequences[0].token_ids)) for s in ex.steps]
    assert starts == [(0, 3), (3, 3), (6, 2), (8, 1)]
    assert out["tokens"] == _run_alone(list(range(1, 9)), max_tokens=2, temperature=0)["tokens"]


def test_eos_and_callback_stops_end_a_request_with_reason_stop():
    ex = HistoryExecutor()
    first = _run_alone([4, 4], max_tokens=5, temperature=0)["tokens"]
    sched = Scheduler(ex, eos_token_ids=(first[1],))
    req, out, _ = _collect([4, 4], max_tokens=5, temperature=0)
    sched.submit(req)
    while sched.step():
        pass
    assert out["reason"] == "stop" and out["tokens"] == first[:1]
    stopped = []
    req2 = Request(
        [4, 4],
        SamplingParams(max_tokens=5, temperature=0),
        lambda t: True,
        lambda r, e: stopped.append(r),
    )
    sched.submit(req2)
    while sched.step():
        pass
    assert stopped == ["stop"]


def test_generation_stops_at_the_context_length():
    ex = HistoryExecutor(max_seq_len=10)
    sched = Scheduler(ex)
    req, out, _ = _collect(list(range(1, 8)), max_tokens=100, temperature=0)
    sched.submit(req)
    while sched.step():
        pass
    assert out["reason"] == "length" and len(out["tokens"]) == 3


def test_prompt_longer_than_context_and_bad_params_are_rejected():
    sched = Scheduler(HistoryExecutor(max_seq_len=10))
    with pytest.raises(RequestRejected, match="context"):
        sched.submit(_collect(list(range(10)), max_tokens=1)[0])
    with pytest.raises(RequestRejected, match="empty"):
        sched.submit(_collect([], max_tokens=1)[0])
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_executor_failure_fails_every_request_and_refuses_new_ones():
    ex = HistoryExecutor(fail_after=2)
    sched = Scheduler(ex)
    reqs = [_collect([1, 2], max_tokens=10, temperature=0) for _ in range(3)]
    for req, _, _ in reqs:
        sched.submit(req)
    while sched.step():
        pass
    for _, out, _ in reqs:
        assert out["reason"] == "error" and isinstance(out["error"], EngineUnavailable)
    with pytest.raises(EngineUnavailable, match="rank 1 closed"):
        sched.submit(_collect([1], max_tokens=1)[0])


def test_background_loop_serves_concurrent_submitters_and_cancellation():
    ex = HistoryExecutor(max_batch=4)
    sched = Scheduler(ex)
    sched.start()
    try:
        waits = []
        for i in range(6):
            req, out, done = _collect([i + 2, 3], max_tokens=5, temperature=0)
            sched.submit(req)
            waits.append((out, done, i))
        cancel, cout, cdone = _collect([1, 1], max_tokens=50, temperature=0)
        cancel.cancel()
        sched.submit(cancel)
        for out, done, i in waits:
            assert done.wait(10)
            assert out["tokens"] == _run_alone([i + 2, 3], max_tokens=5, temperature=0)["tokens"]
        assert cdone.wait(10) and cout["reason"] == "cancelled"
    finally:
        sched.stop()


def test_over_a_pipeline_one_group_per_stage_is_in_flight_and_outputs_match():
    from _serving_doubles import PipelineHistoryExecutor

    ex = PipelineHistoryExecutor(num_stages=2, max_batch=4)
    sched = Scheduler(ex)
    outs = []
    for i in range(4):
        req, out, _ = _collect([i + 3, 1, 4], max_tokens=6, temperature=0)
        sched.submit(req)
        outs.append(out)
    while sched.step():
        pass
    assert ex.max_in_flight == 2 and not ex.pending
    assert all(len(s.sequences) == 2 for s in ex.steps)  # 4 running, 2 stages: groups of 2
    for i, out in enumerate(outs):
        assert out["reason"] == "length"
        assert out["tokens"] == _run_alone([i + 3, 1, 4], max_tokens=6, temperature=0)["tokens"]
    assert sorted(ex.released) == [0, 1, 2, 3]
