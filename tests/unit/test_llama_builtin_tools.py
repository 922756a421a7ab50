"""Llama 3.1's built-in tool calls through both APIs (`--tool-call-parser llama3`) over a double
that writes `<|python_tag|>brave_search.call(query="...")`: with `brave_search` declared the
answer is that call (OpenAI's `tool_calls`, whole and streamed; the official `ollama` client's
`message.tool_calls`, arguments an object, the client reaching a real loopback server through its
public `host=`); without it the text stays content. llama.cpp's aliases: a tool declared as
`web_search` gets the model's `brave_search` call under its own name (and the template Meta's
name), one declared as `python` the raw code. A forced built-in call (`tool_choice` naming it) is
held to the dotted form: the grammar takes the call the model writes, refuses the JSON object,
and a JSON value a parameter's schema forbids."""

import json

import ollama
import pytest
from _serving_doubles import AsciiTokenizer, ScriptedExecutor
from fastapi.testclient import TestClient
from http_server_support import running_server

from tandem.engine.grammar import GrammarVocab
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app
from tandem.server.tool_formats import llama3, serve

EOS = 0
MODEL = "tiny-test"
SAID = '<|python_tag|>brave_search.call(query="weather in Oslo")'
CODE = "<|python_tag|>import math\nprint(math.pi)"


def _tool(name, **props):
    params = {"type": "object", "properties": props, "required": list(props)}
    return {"type": "function", "function": {"name": name, "parameters": params}}


SEARCH = _tool("brave_search", query={"type": "string"})
WEB = _tool("web_search", query={"type": "string"})
PYTHON = _tool("python", code={"type": "string"})
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def _engine(script):
    sched = Scheduler(
        ScriptedExecutor(script, eos=EOS, vocab=128, max_seq_len=4096),
        eos_token_ids=(EOS,),
        prefill_budget=4096,  # prompts whole
    )
    sched.start()
    return sched, create_app(ServingEngine(sched, AsciiTokenizer(), MODEL), tool_parser="llama3")


@pytest.fixture
def app(request):
    sched, app = _engine(getattr(request, "param", SAID))
    with TestClient(app) as c:
        yield c
    sched.stop()


def _chat(app, **kw):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80, **kw}
    return app.post("/v1/chat/completions", json=body)


def _call(choice):
    (call,) = choice["message"]["tool_calls"]
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_a_declared_builtin_call_is_a_tool_call_whole_and_streamed(app):
    r = _chat(app, tools=[SEARCH, OTHER]).json()["choices"][0]
    assert _call(r) == ("brave_search", {"query": "weather in Oslo"})
    assert r["finish_reason"] == "tool_calls" and not r["message"]["content"]
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


def test_llama_cpp_s_web_search_alias_gets_the_brave_search_call_under_its_own_name(app):
    r = _chat(app, tools=[WEB, OTHER]).json()["choices"][0]
    assert _call(r) == ("web_search", {"query": "weather in Oslo"})
    assert llama3.bind([WEB, PYTHON])[1] == {"builtin_tools": ["brave_search", "code_interpreter"]}


@pytest.mark.parametrize("app", [CODE], indirect=True)
def test_llama_cpp_s_python_alias_gets_the_raw_code(app):
    r = _chat(app, tools=[PYTHON]).json()["choices"][0]
    assert _call(r) == ("python", {"code": "import math\nprint(math.pi)"})


def test_a_forced_builtin_call_is_held_to_the_dotted_form(app):
    named = {"type": "function", "function": {"name": "web_search"}}
    r = _chat(app, tools=[WEB, OTHER], tool_choice=named).json()["choices"][0]
    assert _call(r) == ("web_search", {"query": "weather in Oslo"})
    assert r["finish_reason"] == "tool_calls"
    vocab = GrammarVocab.of(AsciiTokenizer())
    served = serve(llama3.FORMAT, AsciiTokenizer())
    spec = served.call_grammar([_tool("brave_search", query={"type": "string"},
                                      n={"type": "integer"})])  # fmt: skip

    def takes(text):
        mask = vocab.mask(spec)
        for c in text:
            if not mask.allowed()[ord(c)]:
                return False
            mask.advance(ord(c))
        return mask.accepting

    assert takes('<|python_tag|>brave_search.call(query="x y", n=3)')
    assert not takes('{"name": "brave_search", "parameters": {"query": "x y", "n": 3}}')
    assert not takes('<|python_tag|>brave_search.call(query="x y", n="3")')
    assert not takes('<|python_tag|>web_search.call(query="x y", n=3)')


def test_the_ollama_client_gets_the_builtin_call_with_object_arguments():
    sched, app = _engine(SAID)
    with running_server(app) as port:
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)
        r = client.chat(MODEL, ASK, tools=[SEARCH], options={"num_predict": 80})
    sched.stop()
    (call,) = r.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == (
        "brave_search",
        {"query": "weather in Oslo"},
    )
