"""Llama 3.1's built-in tool calls through both APIs (`--tool-call-parser llama3`) over a double
that writes `<|python_tag|>brave_search.call(query="...")`: with `brave_search` declared the
answer is that call (OpenAI's `tool_calls`, whole and streamed; the official `ollama` client's
`message.tool_calls`, arguments an object); without it the text stays content."""

import json

import ollama
import pytest
from _serving_doubles import ScriptedExecutor
from fastapi.testclient import TestClient
from test_grammar_mask import EOS, AsciiTokenizer

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app

MODEL = "tiny-test"
SAID = '<|python_tag|>brave_search.call(query="weather in Oslo")'
SEARCH = {
    "type": "function",
    "function": {
        "name": "brave_search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture
def app():
    sched = Scheduler(
        ScriptedExecutor(SAID, eos=EOS, vocab=128, max_seq_len=4096),
        eos_token_ids=(EOS,),
        prefill_budget=4096,  # prompts whole
    )
    sched.start()
    with TestClient(
        create_app(ServingEngine(sched, AsciiTokenizer(), MODEL), tool_parser="llama3")
    ) as c:
        yield c
    sched.stop()


def _chat(app, **kw):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80, **kw}
    return app.post("/v1/chat/completions", json=body)


def test_a_declared_builtin_call_is_a_tool_call_whole_and_streamed(app):
    r = _chat(app, tools=[SEARCH, OTHER]).json()["choices"][0]
    (call,) = r["message"]["tool_calls"]
    assert call["function"]["name"] == "brave_search" and r["finish_reason"] == "tool_calls"
    assert json.loads(call["function"]["arguments"]) == {"query": "weather in Oslo"}
    assert not r["message"]["content"]
    lines = _chat(app, tools=[SEARCH], stream=True).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    pieces = [t for d in deltas for t in d.get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "brave_search"
    args = "".join(t["function"]["arguments"] for t in pieces)
    assert json.loads(args) == {"query": "weather in Oslo"}
    assert not any(d.get("content") for d in deltas)


def test_undeclared_the_same_text_stays_content(app):
    r = _chat(app, tools=[OTHER]).json()["choices"][0]
    assert r["message"]["content"] == SAID and not r["message"].get("tool_calls")


def test_the_ollama_client_gets_the_builtin_call_with_object_arguments(app):
    client = ollama.Client(host=str(app.base_url))
    client._client = app  # the client's own requests, over the in-process app
    r = client.chat(MODEL, ASK, tools=[SEARCH], options={"num_predict": 80})
    (call,) = r.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == (
        "brave_search",
        {"query": "weather in Oslo"},
    )
