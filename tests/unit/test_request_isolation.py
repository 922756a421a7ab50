"""One bad request fails alone: sampling parameters out of range are 400s at the edge, a request
that fails in the scheduler's thread fails by itself while the others complete, and a scheduler
whose loop dies fails what is waiting and turns /health 503 instead of leaving requests hanging.
A real uvicorn server and httpx (with timeouts: a hang fails the test)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from http_server_support import running_server

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, RequestFailed, Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app

MODEL = "tiny-test"


def _engine(executor=None) -> ServingEngine:
    ex = executor or HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=64)
    sched = Scheduler(ex)
    sched.start()
    return ServingEngine(sched, CharTokenizer(), MODEL)


def _chat(port: int, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    body.update(kw)
    return httpx.post(  # json.dumps writes NaN and Infinity as Python's json reads them
        f"http://127.0.0.1:{port}/v1/chat/completions",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=10,
    )


OUT_OF_RANGE = [
    ("seed", 18446744073709551616),
    ("seed", -(1 << 63) - 1),
    ("temperature", 2.5),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", float("inf")),
    ("top_k", -2),
    ("max_tokens", 1 << 40),
    ("stop", ["x"] * 17),
]


def test_sampling_parameters_out_of_range_are_400s_naming_the_field() -> None:
    engine = _engine()
    try:
        with running_server(create_app(engine)) as port:
            for field, value in OUT_OF_RANGE:
                r = _chat(port, **{field: value})
                assert r.status_code == 400, (field, value, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["param"] == field, err
            assert _chat(port, temperature=0).status_code == 200  # the engine serves on
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        engine.scheduler.stop()


def test_a_temperature_of_1e_40_samples_greedily_instead_of_killing_the_scheduler() -> None:
    engine = _engine()
    try:
        with running_server(create_app(engine)) as port:
            tiny = _chat(port, temperature=1e-40, seed=3)
            assert tiny.status_code == 200, tiny.text
            greedy = _chat(port, temperature=0)
            text = greedy.json()["choices"][0]["message"]["content"]
            assert tiny.json()["choices"][0]["message"]["content"] == text
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        engine.scheduler.stop()


class _PoisonedRows(HistoryExecutor):
    """NaN logits for the first sequence: sampling it (temperature 1) cannot succeed."""

    def run(self, step):
        out = super().run(step)
        for row, s in enumerate(step.sequences):
            if s.seq_id == 0:
                out.logits[row] = float("nan")
        return out


def test_a_request_that_fails_in_the_scheduler_thread_fails_alone() -> None:
    sched = Scheduler(_PoisonedRows(vocab=128))
    sched.start()
    done: dict[str, tuple] = {}
    events = {k: threading.Event() for k in ("nan", "raises", "fine")}

    def finish(name):
        def cb(reason, error):
            done[name] = (reason, error)
            events[name].set()

        return cb

    def boom(_token):
        raise KeyError("a broken callback")

    try:
        sampled = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
        sched.submit(Request([1, 2, 3], sampled, lambda t: False, finish("nan")))
        sched.submit(
            Request([1, 2], SamplingParams(max_tokens=5, temperature=0), boom, finish("raises"))
        )
        sched.submit(
            Request(
                [4, 5], SamplingParams(max_tokens=5, temperature=0), lambda t: False, finish("fine")
            )
        )
        assert all(e.wait(10) for e in events.values()), done
        assert done["nan"][0] == "error" and isinstance(done["nan"][1], RequestFailed)
        assert done["raises"][0] == "error" and "broken callback" in str(done["raises"][1])
        assert done["fine"] == ("length", None)
        assert sched.failure is None
    finally:
        sched.stop()


def test_a_scheduler_whose_loop_dies_fails_waiting_requests_and_health_turns_503() -> None:
    engine = _engine()

    def broken(group):
        raise RuntimeError("a bug in the step builder")

    engine.scheduler._build = broken  # the loop itself raises, outside any one request
    try:
        with running_server(create_app(engine)) as port:
            r = _chat(port, temperature=0)
            assert r.status_code == 503 and "scheduler stopped" in r.json()["error"]["message"]
            h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            assert h.status_code == 503 and "scheduler stopped" in h.json()["detail"]
            assert _chat(port).status_code == 503  # refused at once, not queued forever
    finally:
        engine.scheduler.stop()


def test_sampling_params_refuse_a_seed_outside_int64_and_uint64() -> None:
    from tandem.engine.sampling_params import SamplingParamsError, make_generator

    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams(seed=1 << 64)
    assert SamplingParams(temperature=1e-40).greedy
    for seed in ((1 << 64) - 1, -(1 << 63)):  # both ends of the range make a generator
        SamplingParams(seed=seed)
        make_generator(seed).random()
