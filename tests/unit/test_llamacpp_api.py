"""llama.cpp's native `/completion`, `/tokenize` and `/detokenize` (`tandem.server.llamacpp`) over
the serving stack on a history-driven executor: the same greedy text as /v1/completions, streamed
or not; why it stopped (eos, word, limit); the grammar and JSON schema constraining it; the top
logprobs; `cache_prompt: false` prefilling the whole prompt; `logit_bias` in both of llama.cpp's
forms, `false` and text ids too; another model's name ignored; every field tandem does not
honour a 400 naming it; and the routes behind the API key."""

import json

import jsonschema
import pytest
from _serving_doubles import AsciiTokenizer, HistoryExecutor
from fastapi.testclient import TestClient

from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app

MODEL = "tiny-test"
PROMPT = "tell me a story"


def _engine():
    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=96, rewind=True)
    sched = Scheduler(ex, eos_token_ids=(0,), prefix_cache=PrefixCache(min_tokens=4))
    sched.start()
    return sched, ServingEngine(sched, AsciiTokenizer(), MODEL)


@pytest.fixture(scope="module")
def client():
    sched, engine = _engine()
    with TestClient(create_app(engine)) as c:
        yield c
    sched.stop()


def _events(r):
    """The SSE stream's objects (every line `data: {...}`; no [DONE])."""
    lines = [x for x in r.text.split("\n\n") if x]
    assert all(x.startswith("data: {") for x in lines), lines
    return [json.loads(x[len("data: ") :]) for x in lines]


def test_completion_streamed_and_not_is_the_openai_routes_greedy_text(client):
    want = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "temperature": 0},
    ).json()["choices"][0]["text"]
    body = {"prompt": PROMPT, "n_predict": 9, "temperature": 0, "return_tokens": True}
    r = client.post("/completion", json=body).json()
    assert r["content"] == want and r["stop"] is True
    assert r["stop_type"] == "limit" and r["tokens_predicted"] == 9
    assert "".join(chr(t) for t in r["tokens"]) == want
    assert r["tokens_evaluated"] == len(PROMPT) and r["generation_settings"]["n_predict"] == 9
    events = _events(client.post("/completion", json={**body, "stream": True}))
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == want
    assert [t for e in events[:-1] for t in e["tokens"]] == r["tokens"]
    assert events[-1]["stop_type"] == "limit" and events[-1]["content"] == ""
    ids = client.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    by_ids = client.post("/completions", json={**body, "prompt": ids}).json()
    assert by_ids["content"] == want


def test_a_stop_string_is_a_word_stop_and_a_grammar_ends_on_eos(client):
    body = {"prompt": PROMPT, "n_predict": 9, "temperature": 0}
    text = client.post("/completion", json=body).json()["content"]
    word = text[3:5]
    r = client.post("/completion", json={**body, "stop": [word]}).json()
    assert r["content"] == text[: text.index(word)]
    assert (r["stop_type"], r["stopping_word"]) == ("word", word)
    r = client.post("/completion", json={**body, "grammar": 'root ::= "yes" | "no"'}).json()
    assert r["content"] in ("yes", "no") and r["stop_type"] == "eos"


def test_a_json_schema_constrains_the_answer(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
        "required": ["colour", "n"],
        "additionalProperties": False,
    }
    for seed in (1, 2):
        body = {"prompt": PROMPT, "n_predict": 40, "json_schema": schema, "seed": seed}
        r = client.post("/completion", json=body).json()
        jsonschema.validate(json.loads(r["content"]), schema)


def test_n_probs_gives_each_tokens_top_logprobs_greedy_first(client):
    body = {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "n_probs": 3}
    r = client.post("/completion", json=body).json()
    probs = r["completion_probabilities"]
    assert len(probs) == r["tokens_predicted"] == 5
    assert "".join(p["token"] for p in probs) == r["content"]
    for p in probs:
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    streamed = _events(client.post("/completion", json={**body, "stream": True}))
    again = [p for e in streamed[:-1] for p in e["completion_probabilities"]]
    assert again == probs


def test_logit_bias_in_either_of_llama_cpp_s_forms_moves_the_greedy_choice(client):
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0}
    assert client.post("/completion", json=body).json()["content"] != "zzzz"
    for bias in ([[ord("z"), 100]], {str(ord("z")): 100.0}):
        r = client.post("/completion", json={**body, "logit_bias": bias}).json()
        assert r["content"] == "zzzz"


def test_logit_bias_false_bans_a_token_and_text_ids_bias_each_of_their_tokens(client):
    """llama.cpp's `false` (never) takes the greedy token's place; a text key biases every token
    of the text, so "zy" at +100 writes only z and y; another model's name is ignored."""
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "model": "not-this-one"}
    plain = client.post("/completion", json=body).json()
    assert plain["model"] == MODEL
    first = ord(plain["content"][0])
    for bias in ([[first, False]], {str(first): False}):
        banned = client.post("/completion", json={**body, "logit_bias": bias}).json()["content"]
        assert chr(first) not in banned and len(banned) == 6
    for bias in ([["zy", 100]], {"zy": 100}):
        text = client.post("/completion", json={**body, "logit_bias": bias}).json()["content"]
        assert set(text) <= {"z", "y"} and len(text) == 6


def test_cache_prompt_false_prefills_the_whole_prompt():
    sched, engine = _engine()
    with TestClient(create_app(engine)) as c:
        body = {"prompt": PROMPT, "n_predict": 3, "temperature": 0}
        first = c.post("/completion", json=body).json()
        cached = c.post("/completion", json=body).json()
        whole = c.post("/completion", json={**body, "cache_prompt": False}).json()
    sched.stop()
    assert first["tokens_cached"] == 0 and cached["tokens_cached"] > 0
    assert whole["tokens_cached"] == 0 and whole["timings"]["prompt_n"] == len(PROMPT)
    assert first["content"] == cached["content"] == whole["content"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"no_such_field": 1}, "no_such_field"),
        ({"mirostat": 2}, "mirostat"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"n_predict": 0}, "n_predict"),
        ({"top_p": 0.0}, "top_p"),
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"n_probs": 99}, "n_probs"),
        ({"grammar": "root ::= undefined"}, "grammar"),
        ({"json_schema": {"type": "no-such"}}, "json_schema"),
        ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
        ({"prompt": [1, "two"]}, "prompt"),
        ({"logit_bias": [[65, True]]}, "logit_bias"),
        ({"logit_bias": [[65, 500]]}, "logit_bias"),
        ({"logit_bias": {"A": "up"}}, "logit_bias"),
        ({"logit_bias": [[300, False]]}, "logit_bias"),
        ({"prompt": [300]}, None),
    ],
)
def test_what_tandem_does_not_honour_is_a_400_naming_it(client, extra, param):
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_off_values_of_samplers_tandem_lacks_are_accepted(client):
    off = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "id_slot": -1, "seed": -1}
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, **off})
    assert r.status_code == 200, r.text


def test_tokenize_and_detokenize_round_trip(client):
    r = client.post("/tokenize", json={"content": "hi!", "with_pieces": True}).json()
    assert r["tokens"] == [{"id": 104, "piece": "h"}, {"id": 105, "piece": "i"},
                           {"id": 33, "piece": "!"}]  # fmt: skip
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"content": "hi"}
    bad = client.post("/tokenize", json={"content": "x", "parse_special": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "parse_special"
    assert client.post("/detokenize", json={"tokens": [999]}).status_code == 400


def test_the_native_routes_are_behind_the_api_key():
    sched, engine = _engine()
    with TestClient(create_app(engine, api_key="k")) as c:
        for path, body in (("/completion", {"prompt": "x"}), ("/tokenize", {"content": "x"}),
                           ("/detokenize", {"tokens": [1]})):  # fmt: skip
            assert c.post(path, json=body).status_code == 401
        ok = c.post("/tokenize", json={"content": "x"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
    sched.stop()
