"""The HTTP API in-process over the executor double: OpenAI shapes, errors, auth, health, metrics."""

import json

import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from fastapi.testclient import TestClient

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine, TextStream
from tandem.server.app import create_app

MODEL = "tiny-test"


def _engine(**kw):
    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=kw.pop("max_seq_len", 64), **kw)
    sched = Scheduler(ex)
    sched.start()
    return ServingEngine(sched, CharTokenizer(), MODEL)


@pytest.fixture
def client():
    engine = _engine()
    with TestClient(create_app(engine)) as c:
        yield c
    engine.scheduler.stop()


def _chat(client, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    body.update(kw)
    return client.post("/v1/chat/completions", json=body)


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


def test_streamed_chat_concatenates_to_the_non_streamed_text(client):
    whole = _chat(client, max_tokens=12).json()
    text = whole["choices"][0]["message"]["content"]
    assert len(text) == 12 and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12
    r = _chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_stop_string_ends_the_text_before_it_streamed_or_not(client):
    text = _chat(client, max_tokens=12).json()["choices"][0]["message"]["content"]
    stop = text[5:7]
    cut = text.index(stop)
    r = _chat(client, max_tokens=12, stop=[stop]).json()
    assert r["choices"][0]["message"]["content"] == text[:cut]
    assert r["choices"][0]["finish_reason"] == "stop"
    s = _chat(client, max_tokens=12, stop=stop, stream=True).text
    chunks = [json.loads(x[6:]) for x in s.splitlines() if x.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text[:cut]


def test_text_completion_takes_a_prompt_and_defaults_to_16_tokens(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"][0]["text"]) == 16
    assert body["usage"]["prompt_tokens"] == 3


def test_openai_style_errors_for_unknown_model_bad_max_tokens_and_long_prompt(client):
    r = _chat(client, model="gpt-9")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = _chat(client, max_tokens=-3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 64})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _chat(client, temperature=-1)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 100000]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # one bad request does not take the engine down


def test_api_key_is_required_on_v1_when_set():
    engine = _engine()
    try:
        with TestClient(create_app(engine, api_key="sekrit")) as c:
            assert _chat(c).status_code == 401
            r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            ok = c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        engine.scheduler.stop()


def test_health_turns_503_and_requests_fail_cleanly_when_the_executor_dies():
    engine = _engine(fail_after=3)
    try:
        with TestClient(create_app(engine)) as c:
            assert c.get("/health").status_code == 200
            r = _chat(c, max_tokens=20)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            h = c.get("/health")
            assert h.status_code == 503 and "rank 1 closed" in h.json()["detail"]
            assert _chat(c).status_code == 503
    finally:
        engine.scheduler.stop()


def test_metrics_expose_requests_tokens_and_latencies_in_prometheus_text(client):
    _chat(client, max_tokens=5)
    text = client.get("/metrics").text
    assert 'tandem_requests_total{finish_reason="length"} 1' in text
    assert "tandem_generation_tokens_total 5" in text
    assert "tandem_time_to_first_token_seconds_count 1" in text
    assert "# TYPE tandem_decode_step_seconds histogram" in text
    assert 'tandem_http_requests_total{path="/v1/chat/completions",status="200"} 1' in text


def test_text_stream_holds_back_split_utf8_and_partial_stop_strings():
    data = "héllo wörld".encode()

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    s = TextStream(decode)
    out = "".join(s.push(b)[0] for b in data) + s.flush()
    assert out == "héllo wörld"
    s = TextStream(decode, stop=("wö",))
    deltas = []
    for b in data:
        d, hit = s.push(b)
        deltas.append(d)
        if hit:
            break
    assert "".join(deltas) == "héllo " and hit
    assert all("w" not in d for d in deltas)


def test_latency_histograms_are_cumulative_and_never_shrink():
    from tandem.engine.histogram import Histogram

    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["buckets"] == [(0.1, 1), (1.0, 3)] and snap["count"] == 4
    for _ in range(10000):
        h.observe(0.05)
    assert h.snapshot()["buckets"][0] == (0.1, 10001)


def test_cached_tokens_are_in_the_usage_the_metrics_and_the_cluster_view():
    from tandem.engine.prefix_cache import BlockSize, PrefixCache

    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16, block=BlockSize(16, 1000)))
    sched.start()
    engine = ServingEngine(sched, CharTokenizer(), MODEL)
    prompt = "a system prompt of some forty characters."
    try:
        with TestClient(create_app(engine)) as c:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0}
            first = c.post("/v1/completions", json=body).json()
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            body["prompt"] = prompt + first["choices"][0]["text"] + " next"
            r = c.post("/v1/completions", json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}})  # fmt: skip
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            held = len(prompt) + 4  # the fifth generated token was never fed
            assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": held}
            metrics = c.get("/metrics").text
            for line in (
                "tandem_prefix_cache_hits_total 1",
                "tandem_prefix_cache_misses_total 1",
                f"tandem_prefix_cache_cached_tokens_total {held}",
                "tandem_prefix_cache_entries 1",
                "# TYPE tandem_prefix_cache_entries gauge",
            ):
                assert line in metrics.splitlines(), line
            view = c.get("/v1/cluster").json()["prefix_cache"]
            assert view["hits"] == 1 and view["reused_tokens"] == held and view["entries"] == 1
            assert view["copies"] == 0
            # a prompt that parts from the kept one early: its shared part copied, counted cached
            other = c.post("/v1/completions", json={**body, "prompt": prompt + "!"}).json()
            assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt)}
            metrics = c.get("/metrics").text.splitlines()
            assert "tandem_prefix_cache_copies_total 1" in metrics
            assert f"tandem_prefix_cache_cached_tokens_total {held + len(prompt)}" in metrics
            view = c.get("/v1/cluster").json()["prefix_cache"]
            assert view["copies"] == 1
            # blocks of 16: the continued entry's 55 tokens hold 4, the copy's 46 hold 3 of
            # which the first 2 (the 41 shared tokens' whole blocks) are the entry's: 5 in all,
            # every one held by kept entries only (nothing runs)
            assert view["held_blocks"] == 5 and view["cache_bytes"] == 5 * 1000
            assert "tandem_prefix_cache_blocks 5" in metrics
            assert "tandem_prefix_cache_bytes 5000" in metrics
    finally:
        sched.stop()


def test_without_a_prefix_cache_metrics_leave_its_series_out_and_usage_says_zero(client):
    r = _chat(client, max_tokens=3).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "tandem_prefix_cache" not in client.get("/metrics").text
    assert client.get("/v1/cluster").json()["prefix_cache"] is None


@pytest.mark.parametrize("whole_only", [False, True])
def test_n_choices_report_one_usage_whose_cached_tokens_no_choice_prefilled(whole_only):
    """n=3 continuing a kept entry: choice 0 takes it over (`held` positions cached); choices 1
    and 2 copy choice 0's prompt, or, where the executor copies only whole sequences (a hybrid's
    rule), prefill it all again. The request reports the positions none of them prefilled."""
    from tandem.engine.prefix_cache import BlockSize, PrefixCache

    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=256, rewind=True,
                         whole_only=whole_only)  # fmt: skip
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16, block=BlockSize(16, 1000)))
    sched.start()
    engine = ServingEngine(sched, CharTokenizer(), MODEL)
    prompt = "a system prompt of some forty characters."
    try:
        with TestClient(create_app(engine)) as c:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0}
            first = c.post("/v1/completions", json=body).json()
            held = len(prompt) + 4  # the fifth generated token was never fed
            body["prompt"] = prompt + first["choices"][0]["text"] + " next"
            three = c.post("/v1/completions", json={**body, "n": 3}).json()
            assert len({ch["text"] for ch in three["choices"]}) == 1
            usage = three["usage"]
            assert usage["prompt_tokens"] == len(body["prompt"])  # once, not per choice
            assert usage["completion_tokens"] == 3 * 5
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0 if whole_only else held}
    finally:
        sched.stop()
