"""Tool calls (`tandem.server.tools`): `<tool_call>` blocks parsed into OpenAI's `tool_calls`,
messages with calls and tool results written for a template with and without native tools, the
plan of each `tool_choice`, and through the API over the double: `required` and a named function
give one call whose arguments validate against its schema, streamed as one delta at the end."""

import json

import jsonschema
import pytest
from _serving_doubles import HistoryExecutor
from fastapi.testclient import TestClient
from test_grammar_mask import EOS, VOCAB, AsciiTokenizer, _allowed_chars, _feed

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import Completion, ServingEngine
from tandem.server import tools
from tandem.server.app import create_app
from tandem.server.protocol import APIError

MODEL = "tiny-test"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


def _parsed(text: str) -> tuple[str, list]:
    from tandem.server.answers import ChoiceAnswer
    from tandem.server.ollama import PLAIN

    part = ChoiceAnswer(PLAIN.reader([]), True).whole(Completion(text, "stop", 1, 1))
    return part.content, part.calls


def test_tool_call_blocks_become_tool_calls_and_the_rest_stays_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = _parsed(text)
    assert content == "Let me look."
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    text = "no calls <tool_call>not json</tool_call>"
    assert _parsed(text) == (text, [])


def test_messages_are_written_natively_or_in_the_hermes_forms():
    call = {"id": "c1", "type": "function", "function": {"name": "noop", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]
    native = tools.template_messages(msgs, TOOLS, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {}  # an object, as transformers
    assert native[2]["role"] == "tool"
    hermes = tools.template_messages(msgs, TOOLS, native=False)
    assert hermes[0]["role"] == "system" and "get_weather" in hermes[0]["content"]
    assert '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>' == hermes[2]["content"]
    assert hermes[3] == {"role": "user", "content": "<tool_response>\ndone\n</tool_response>"}


def test_each_tool_choice_plans_its_prompt_and_grammar():
    assert tools.plan(None, None) is None and tools.plan(TOOLS, "none") is None
    auto = tools.plan(TOOLS, "auto")
    assert auto.grammar is None and auto.parse and auto.tools == TOOLS
    assert tools.plan(TOOLS, "required").grammar is not None
    named = tools.plan(TOOLS, {"type": "function", "function": {"name": "noop"}})
    assert [t["function"]["name"] for t in named.tools] == ["noop"]
    for tools_, choice in [
        (TOOLS, {"function": {"name": "nope"}}),
        (None, "required"),
        ([{"type": "x"}], "auto"),
    ]:
        with pytest.raises(APIError):
            tools.plan(tools_, choice)


def test_a_forced_call_s_grammar_takes_only_a_call_that_validates():
    mask = VOCAB.mask(tools.call_grammar(TOOLS[:1]))
    _feed(mask, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    assert _allowed_chars(mask) == {"P", "O"}
    _feed(mask, 'Oslo", "days": 3}}\n</tool_call>')
    assert _allowed_chars(mask) == {"EOS"}


@pytest.fixture
def client():
    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=2048)
    sched = Scheduler(ex, eos_token_ids=(EOS,))
    sched.start()
    with TestClient(create_app(ServingEngine(sched, AsciiTokenizer(), MODEL))) as c:
        yield c
    sched.stop()


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_call_comes_back_as_tool_calls_whose_arguments_validate(client, choice):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "tool_choice": choice, "max_tokens": 120, "temperature": 1.0, "seed": 5}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body).json()
    (choice_,) = r["choices"]
    assert choice_["finish_reason"] == "tool_calls"
    (call,) = choice_["message"]["tool_calls"]
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec[call["function"]["name"]])
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"
    stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    events = [json.loads(x[6:]) for x in stream.splitlines() if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    pieces = [t for d in deltas for t in d.get("tool_calls", [])]
    assert {t["index"] for t in pieces} == {0}
    assert pieces[0]["id"].startswith("call_") and pieces[0]["type"] == "function"
    assert all("id" not in t and "name" not in t["function"] for t in pieces[1:])
    streamed = json.loads("".join(t["function"]["arguments"] for t in pieces))
    jsonschema.validate(streamed, spec[pieces[0]["function"]["name"]])
    assert not any(d.get("content") for d in deltas)  # no raw `<tool_call>` text
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_ollama_chat_offers_tools_takes_calls_and_results_back_and_returns_calls():
    from tandem.server.answers import ChoiceAnswer
    from tandem.server.ollama import PLAIN, _said

    def message(text: str, parse: bool) -> dict:
        part = ChoiceAnswer(PLAIN.reader([]), parse).whole(Completion(text, "stop", 1, 1))
        return _said(part, chat=True, thinking=True)["message"]

    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    (call,) = message(text, parse=True)["tool_calls"]
    assert call == {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
    assert message(text, parse=False) == {"role": "assistant", "content": text}


def test_ollama_chat_with_tools_and_a_round_trip_is_answered(client):
    msgs = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "noop", "arguments": {}}}],
        },
        {"role": "tool", "content": "done", "tool_name": "noop"},
    ]
    body = {
        "model": MODEL,
        "messages": msgs,
        "tools": TOOLS,
        "stream": False,
        "options": {"num_predict": 4},
    }
    r = client.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["role"] == "assistant"
    lines = client.post("/api/chat", json={**body, "stream": True}).text.splitlines()
    assert json.loads(lines[-1])["done"] and not json.loads(lines[0])["done"]
    bad = {**body, "messages": [{"role": "assistant", "tool_calls": "x"}]}
    assert client.post("/api/chat", json=bad).status_code == 400


def test_a_call_cut_by_the_token_limit_finishes_with_length_as_openai():
    from tandem.server.answers import ChoiceAnswer
    from tandem.server.ollama import PLAIN

    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    for reason, want in [("length", "length"), ("stop", "tool_calls")]:
        answer = ChoiceAnswer(PLAIN.reader([]), True)
        done = Completion(text, reason, 1, 1)
        (call,) = answer.whole(done).calls
        assert call["function"]["arguments"] == '{"city": "Os'  # as written, like OpenAI's
        assert answer.finish_reason(done) == want
