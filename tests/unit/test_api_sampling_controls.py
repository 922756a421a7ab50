"""The OpenAI API in-process over the executor double: logprobs in chat's and completions' shapes
(streamed too, cut at a stop string), n choices, logit_bias and penalties, and a 400 naming the
field for every value out of range and every field tandem does not honour."""

import json
import math

import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from fastapi.testclient import TestClient

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app

MODEL = "tiny-test"


@pytest.fixture
def client():
    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=64)
    sched = Scheduler(ex)
    sched.start()
    with TestClient(create_app(ServingEngine(sched, CharTokenizer(), MODEL))) as c:
        yield c
    sched.stop()


def _chat(client, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    body.update(kw)
    return client.post("/v1/chat/completions", json=body)


def _complete(client, **kw):
    body = {"model": MODEL, "prompt": "abc", "temperature": 0, "max_tokens": 8}
    body.update(kw)
    return client.post("/v1/completions", json=body)


def _events(r):
    return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


def test_chat_logprobs_have_openai_s_shape_and_the_greedy_token_leads(client):
    r = _chat(client, max_tokens=6, logprobs=True, top_logprobs=3).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(e["bytes"]).decode() == e["token"]
        assert len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the top one
        assert e["top_logprobs"][0]["logprob"] == e["logprob"] <= 0.0
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-9
    assert _chat(client, max_tokens=6).json()["choices"][0]["logprobs"] is None
    again = _chat(client, max_tokens=6, logprobs=True, top_logprobs=3).json()
    assert again["choices"][0]["logprobs"] == choice["logprobs"]  # exact and deterministic


def test_completion_logprobs_have_the_legacy_shape_with_offsets(client):
    r = _complete(client, logprobs=2).json()["choices"][0]
    lp = r["logprobs"]
    assert "".join(lp["tokens"]) == r["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == value and len(top) == 2
    zero = _complete(client, logprobs=0).json()["choices"][0]["logprobs"]
    assert all(list(t) == [tok] for t, tok in zip(zero["top_logprobs"], zero["tokens"]))


def test_streamed_logprobs_equal_the_whole_ones_and_stop_at_the_stop_string(client):
    whole = _chat(client, max_tokens=10, logprobs=True, top_logprobs=2).json()["choices"][0]
    events = _events(_chat(client, max_tokens=10, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]
    ]
    assert streamed == whole["logprobs"]["content"]
    text = whole["message"]["content"]
    stop = text[4:6]
    cut = _chat(client, max_tokens=10, logprobs=True, stop=[stop]).json()["choices"][0]
    assert cut["message"]["content"] == text[: text.index(stop)]
    assert "".join(e["token"] for e in cut["logprobs"]["content"]) == cut["message"]["content"]
    events = _events(_complete(client, max_tokens=10, logprobs=1, stream=True))
    tokens = [
        t for ev in events for c in ev["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]
    ]
    assert "".join(tokens) == "".join(c["text"] for ev in events for c in ev["choices"])


def test_n_choices_each_draw_their_own_seeded_stream_streamed_or_not(client):
    r = _chat(client, n=3, max_tokens=8, temperature=1.0, seed=11).json()
    texts = [c["message"]["content"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    assert r["usage"]["completion_tokens"] == 24
    one = _chat(client, max_tokens=8, temperature=1.0, seed=11).json()["choices"][0]
    assert one["message"]["content"] == texts[0]  # choice 0 is the seed's own stream
    events = _events(_chat(client, n=3, max_tokens=8, temperature=1.0, seed=11, stream=True))
    streamed = ["", "", ""]
    for ev in events:
        for c in ev["choices"]:
            streamed[c["index"]] += c["delta"].get("content", "")
    assert streamed == texts
    r = _complete(client, n=2, seed=3, temperature=1.0).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]


def test_logit_bias_moves_and_forces_the_greedy_text_and_penalties_change_it(client):
    plain = _complete(client, max_tokens=1).json()["choices"][0]["text"]
    down = _complete(client, max_tokens=1, logit_bias={str(ord(plain)): -100}).json()
    assert down["choices"][0]["text"] != plain
    up = _complete(client, max_tokens=4, logit_bias={str(ord("Z")): 100}).json()
    assert up["choices"][0]["text"] == "ZZZZ"
    base = _complete(client, max_tokens=12).json()["choices"][0]["text"]
    penalized = _complete(client, max_tokens=12, presence_penalty=2.0).json()["choices"][0]["text"]
    assert len(set(base)) < len(base)  # the double repeats itself greedily
    assert len(set(penalized)) == len(penalized)  # a presence penalty of 2 never does


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("top_logprobs", 21),
        ("n", 9),
        ("n", 0),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"128": 1}),  # outside the vocabulary
        ("temperature", 2.5),
    ],
)
def test_out_of_range_values_are_a_400_naming_the_field(client, field, value):
    r = _chat(client, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_top_logprobs_without_logprobs_and_completion_logprobs_past_5_are_refused(client):
    r = _chat(client, top_logprobs=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = _complete(client, logprobs=6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize(
    "field,value",
    [
        ("response_format", {"type": "xml"}),
        ("tools", [{"type": "web_search"}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "high"),
        ("web_search_options", {}),
        ("chat_template_kwargs", {"tools": []}),  # tandem's to set
        ("no_such_field", 1),
        ("stream_options", {"include_usage": True, "no_such_option": 1}),
    ],
)
def test_chat_fields_tandem_does_not_honour_are_a_400_naming_them(client, field, value):
    r = _chat(client, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "field,value", [("echo", True), ("best_of", 3), ("suffix", "tail"), ("frequency", 1)]
)
def test_completion_fields_tandem_does_not_honour_are_a_400_naming_them(client, field, value):
    r = _complete(client, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_message_parts_and_fields_a_template_would_not_see_are_refused(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = _chat(client, messages=[{"role": "user", "content": [image]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = _chat(client, messages=[{"role": "assistant", "content": None, "tool_calls": "call"}])
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"]
    r = _chat(client, messages=[{"role": "assistant", "content": None, "tool_calls": [call]}])
    # a call goes back through the template (written out, it is longer than this double's context)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_metadata_and_fields_given_their_off_value_are_accepted(client):
    r = _chat(
        client,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="s",
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        parallel_tool_calls=True,
        modalities=["text"],
        stream_options={"include_usage": True, "include_obfuscation": False},
        max_tokens=2,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
            {
                "role": "assistant",
                "content": "yo",
                "refusal": None,
                "tool_calls": None,
                "function_call": None,
                "audio": None,
                "annotations": [],
            },  # fmt: skip
            {"role": "user", "content": "again"},
        ],
    )
    assert r.status_code == 200, r.text
    r = _complete(client, echo=False, best_of=1, suffix=None, user="u")
    assert r.status_code == 200, r.text
