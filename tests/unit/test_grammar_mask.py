"""Structured output's mask (`tandem.engine.grammar`) over a tiny vocabulary (EOS and one token per
printable ASCII character), and the API's answer to it: the mask allows exactly what the schema
permits next, only EOS once the JSON is complete, never nothing on any walk through random
schemas; a schema the engine refuses is a 400 naming `response_format` (or Ollama's `format`)."""

import json

import jsonschema
import numpy as np
import pytest
from _serving_doubles import AsciiTokenizer, HistoryExecutor
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.grammar import GrammarError, GrammarSpec, GrammarVocab
from tandem.engine.sampling_params import SamplingError
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app

EOS = 0
MODEL = "tiny-test"


VOCAB = GrammarVocab.of(AsciiTokenizer())


def _allowed_chars(mask):
    return {chr(i) if i else "EOS" for i in np.flatnonzero(mask.allowed())}


def _feed(mask, text):
    for c in text:
        assert mask.allowed()[ord(c)], (c, text)
        mask.advance(ord(c))


def test_the_mask_allows_what_the_schema_permits_next_and_only_eos_at_the_end():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    mask = VOCAB.mask(GrammarSpec("json", schema))
    assert _allowed_chars(mask) == {"{"}
    _feed(mask, "{")
    assert _allowed_chars(mask) == {'"'}
    _feed(mask, '"a": ')
    assert _allowed_chars(mask) == set("-0123456789")
    _feed(mask, "12")
    assert _allowed_chars(mask) == set("0123456789}")
    _feed(mask, "}")
    assert _allowed_chars(mask) == {"EOS"}
    mask.advance(EOS)


def test_json_object_mode_takes_any_object_and_a_token_outside_the_mask_is_an_error():
    mask = VOCAB.mask(GrammarSpec("json"))
    _feed(mask, '{"x": [1, "y", null]}')
    assert _allowed_chars(mask) == {"EOS"}
    other = VOCAB.mask(GrammarSpec("json"))
    with pytest.raises(SamplingError):
        other.advance(ord("x"))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "no-such-type"},
        {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}},
        {"type": "string", "pattern": "(unclosed"},
    ],
)
def test_a_schema_the_engine_rejects_is_a_grammar_error(schema):
    with pytest.raises(GrammarError):
        VOCAB.mask(GrammarSpec("json", schema))


def test_a_mask_computed_ahead_on_the_pool_equals_the_one_computed_when_asked():
    # the same walk through both: every step's mask bit for bit, a step whose mask nobody asked
    # for (advance alone) included, and the end (only EOS) alike
    schema = {
        "type": "object",
        "properties": {"n": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 3}},
        "required": ["n"],
    }
    ahead = VOCAB.mask(GrammarSpec("json", schema))
    inline = VOCAB.mask(GrammarSpec("json", schema), ahead=False)
    assert ahead.ahead and not inline.ahead
    text = '{"n": ["ab", "cd"]}'
    for i, c in enumerate(text):
        if i % 5 != 3:
            assert np.array_equal(ahead.allowed(), inline.allowed()), text[:i]
        ahead.advance(ord(c))
        inline.advance(ord(c))
    assert ahead.accepting and inline.accepting
    assert _allowed_chars(ahead) == _allowed_chars(inline) == {"EOS"}
    bad = VOCAB.mask(GrammarSpec("json", schema))
    with pytest.raises(SamplingError):
        bad.advance(ord("["))


# ---- property: the mask never empties -----------------------------------------------------------

LEAVES = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "string", "maxLength": 6},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"enum": [1, "two", None]},
    ]
)


def _composite(children):
    obj = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3)
    return st.one_of(
        obj.flatmap(
            lambda props: st.just(
                {"type": "object", "properties": props, "required": sorted(props)[:1]}
            )
        ),
        children.map(lambda item: {"type": "array", "items": item, "maxItems": 3}),
    )


SCHEMAS = st.recursive(LEAVES, _composite, max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_the_mask_never_excludes_every_token_on_a_random_walk(schema, seed):
    rng = np.random.default_rng(seed)
    mask = VOCAB.mask(GrammarSpec("json", schema))
    out = []
    for _ in range(400):
        allowed = np.flatnonzero(mask.allowed())
        assert len(allowed), (schema, "".join(out))
        # prefer closing: the walk ends (EOS, or a token that closes) more often than it grows
        closing = [t for t in allowed if t == EOS or chr(t) in '}]"']
        pool = closing if closing and rng.random() < 0.5 else allowed
        token = int(rng.choice(pool))
        mask.advance(token)
        if token == EOS:
            jsonschema.validate(json.loads("".join(out)), schema)
            return
        out.append(chr(token))


# ---- through the API ----------------------------------------------------------------------------


@pytest.fixture
def client():
    sched = Scheduler(
        HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=96), eos_token_ids=(EOS,)
    )
    sched.start()
    with TestClient(create_app(ServingEngine(sched, AsciiTokenizer(), MODEL))) as c:
        yield c
    sched.stop()


def _chat(client, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}
    body.update(kw)
    return client.post("/v1/chat/completions", json=body)


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_json_schema_response_parses_and_validates(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    r = _chat(client, response_format=fmt, temperature=temperature, seed=3, n=2).json()
    for choice in r["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_completions_and_ollama_format_take_the_grammar_too(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "response_format": fmt}
    r = client.post("/v1/completions", json=body).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)
    body = {"model": MODEL, "prompt": "x", "stream": False, "format": SCHEMA,
            "options": {"num_predict": 60}}  # fmt: skip
    r = client.post("/api/generate", json=body).json()
    jsonschema.validate(json.loads(r["response"]), SCHEMA)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "no-such"}}},
        {"type": "json_schema", "json_schema": {"schema": "not an object"}},
        {"type": "xml"},
    ],
)
def test_a_response_format_the_engine_rejects_is_a_400_naming_it(client, fmt):
    r = _chat(client, response_format=fmt)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_an_ollama_format_the_engine_rejects_is_a_400_naming_it(client):
    body = {"model": MODEL, "prompt": "x", "stream": False, "format": {"type": "no-such"}}
    r = client.post("/api/generate", json=body)
    assert r.status_code == 400 and "format" in r.json()["error"]
