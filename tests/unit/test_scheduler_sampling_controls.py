"""The scheduler with logprobs, penalties, logit_bias and a token mask: a row that needs its logits
makes its steps bring logits, the others keep the greedy ids' fast path; what `on_logprobs` sees
is the tokens `on_token` sees; the pipeline loop samples alike."""

import numpy as np
import pytest
from _serving_doubles import HistoryExecutor, PipelineHistoryExecutor

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, RequestRejected, Scheduler


def _request(prompt, mask=None, **params):
    out = {"tokens": [], "logprobs": [], "reason": None}

    def on_finish(reason, err):
        out["reason"], out["error"] = reason, err

    req = Request(
        list(prompt),
        SamplingParams(**params),
        lambda t: out["tokens"].append(t) and False,
        on_finish,
        on_logprobs=out["logprobs"].append,
        mask=mask,
    )
    return req, out


def _run(ex, *requests):
    sched = Scheduler(ex)
    for req, _ in requests:
        sched.submit(req)
    while sched.step():
        pass
    return [out for _, out in requests]


def test_a_greedy_request_with_logprobs_gets_logits_steps_and_the_top_token_is_its_own():
    ex = HistoryExecutor()
    (out,) = _run(ex, _request([1, 2, 3], max_tokens=5, temperature=0, logprobs=3))
    assert not any(s.greedy for s in ex.steps)
    (plain,) = _run(HistoryExecutor(), _request([1, 2, 3], max_tokens=5, temperature=0))
    assert out["tokens"] == plain["tokens"]  # logprobs do not change the greedy text
    assert [lp.token for lp in out["logprobs"]] == out["tokens"]
    for lp in out["logprobs"]:
        assert lp.top[0] == (lp.token, lp.logprob) and len(lp.top) == 3


def test_plain_greedy_steps_keep_the_ids_fast_path_until_a_logprobs_row_joins():
    ex = HistoryExecutor()
    sched = Scheduler(ex)
    a, out_a = _request([1, 2], max_tokens=6, temperature=0)
    sched.submit(a)
    sched.step()
    sched.step()
    assert all(s.greedy for s in ex.steps)
    b, out_b = _request([5, 6], max_tokens=2, temperature=0, logprobs=0)
    sched.submit(b)
    while sched.step():
        pass
    greedy = [s.greedy for s in ex.steps]
    assert greedy[:2] == [True, True] and not any(greedy[2:4]) and greedy[-1]
    assert out_a["reason"] == "length" and len(out_b["logprobs"]) == 2
    assert out_a["logprobs"] == []  # asked for none


def test_logit_bias_moves_the_greedy_token_and_a_mask_forces_one():
    (plain,) = _run(HistoryExecutor(), _request([1, 2, 3], max_tokens=1, temperature=0))
    first = plain["tokens"][0]
    (down,) = _run(
        HistoryExecutor(),
        _request([1, 2, 3], max_tokens=1, temperature=0, logit_bias=((first, -100.0),)),
    )
    assert down["tokens"][0] != first
    (up,) = _run(
        HistoryExecutor(),
        _request([1, 2, 3], max_tokens=4, temperature=0, logit_bias=((42, 100.0),)),
    )
    assert up["tokens"] == [42] * 4

    class Only:
        def allowed(self):
            keep = np.zeros(50, dtype=bool)
            keep[7] = True
            return keep

        def advance(self, token):
            pass

    (masked,) = _run(
        HistoryExecutor(), _request([1, 2, 3], mask=Only(), max_tokens=3, temperature=0)
    )
    assert masked["tokens"] == [7, 7, 7]


def test_a_presence_penalty_stops_a_greedy_repeat():
    """The double's greedy choice depends on the history; a large presence penalty never
    repeats a token while untaken ones remain."""
    (out,) = _run(
        HistoryExecutor(), _request([1], max_tokens=12, temperature=0, presence_penalty=2.0)
    )
    assert len(set(out["tokens"])) == len(out["tokens"])


def test_logit_bias_outside_the_vocabulary_is_refused_at_submit():
    sched = Scheduler(HistoryExecutor())
    req, _ = _request([1], logit_bias=((50, 1.0),))
    with pytest.raises(RequestRejected, match="logit_bias"):
        sched.submit(req)


def test_the_pipeline_loop_gives_the_same_logprobs_and_tokens():
    one = _run(
        HistoryExecutor(), _request([3, 4], max_tokens=5, temperature=0.8, seed=5, logprobs=2)
    )
    two = _run(
        PipelineHistoryExecutor(num_stages=2),
        _request([3, 4], max_tokens=5, temperature=0.8, seed=5, logprobs=2),
    )
    assert one[0]["tokens"] == two[0]["tokens"]
    assert one[0]["logprobs"] == two[0]["logprobs"]
