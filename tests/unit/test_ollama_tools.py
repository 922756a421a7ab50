"""Tool calls through the official `ollama` client (its own request building and its pydantic
reading of the answers), over the app on a double that writes a Hermes `<tool_call>` block: what
the client sends for `tools` (OpenAI's function shape; a Python function converted from its
docstring; JSON-schema keywords outside its model, such as `minimum` and `additionalProperties`,
dropped by the client before they reach any server), the call returned as Ollama's
`message.tool_calls` with the arguments an object, whole and streamed (no call text in any
chunk's content), and the call and its result (`role: tool`, `tool_name`) going back through the
template. Ollama's API has no field that forces a call (no `tool_choice`): the model chooses, as
`auto` does on the OpenAI side. The client reaches the app over a real loopback server through
its public `host=` (and httpx's `event_hooks`, which it passes on), so an upgrade of the client
that changes its internals still meets these tests as a user's code would."""

import json

import ollama
import pytest
from _serving_doubles import AsciiTokenizer, ScriptedExecutor
from http_server_support import running_server

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app

EOS = 0
MODEL = "tiny-test"
ARGS = {"city": "Oslo", "days": 3}
SAID = "Checking.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS})
SAID += "\n</tool_call>"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def get_time(zone: str) -> str:
    """The time in a zone.

    Args:
      zone: the zone's name
    """
    return "12:00"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    get_time,
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]


@pytest.fixture
def served():
    executor = ScriptedExecutor(SAID, eos=EOS, vocab=128, max_seq_len=4096)
    sched = Scheduler(executor, eos_token_ids=(EOS,), prefill_budget=4096)  # prompts whole
    sched.start()
    sent = []
    hooks = {"request": [lambda r: sent.append(json.loads(r.read() or b"{}"))]}
    with running_server(create_app(ServingEngine(sched, AsciiTokenizer(), MODEL))) as port:
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60, event_hooks=hooks)
        yield client, sent, executor
    sched.stop()


def test_the_client_sends_tools_in_openai_s_function_shape_less_what_its_model_drops(served):
    client, sent, _ = served
    client.chat(MODEL, ASK, tools=TOOLS, options={"num_predict": 200})
    weather, clock = sent[-1]["tools"]
    assert weather == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "required": ["city", "days"],
                "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
            },
        },
    }  # minimum, maximum, additionalProperties: dropped by the client
    assert clock["function"]["name"] == "get_time"
    assert clock["function"]["parameters"]["properties"]["zone"]["type"] == "string"
    assert "tool_choice" not in sent[-1]


def test_a_call_comes_back_as_ollama_s_tool_calls_with_object_arguments(served):
    client, _, _ = served
    r = client.chat(MODEL, ASK, tools=TOOLS, options={"num_predict": 200})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    assert dict(call.function.arguments) == ARGS  # an object: a string would fail the client
    assert r.message.content == "Checking." and r.done


def test_a_streamed_call_comes_whole_in_one_chunk_and_no_call_text_in_content(served):
    client, _, _ = served
    chunks = list(client.chat(MODEL, ASK, tools=TOOLS, stream=True, options={"num_predict": 200}))
    calls = [c for chunk in chunks for c in chunk.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", ARGS)]
    content = "".join(chunk.message.content or "" for chunk in chunks)
    assert content == "Checking." and chunks[-1].done


def test_the_call_and_its_result_go_back_through_the_template(served):
    client, _, executor = served
    r = client.chat(MODEL, ASK, tools=TOOLS, options={"num_predict": 200})
    result = {"role": "tool", "content": '{"temp": -4}', "tool_name": "get_weather"}
    client.chat(MODEL, [*ASK, r.message, result], tools=TOOLS, options={"num_predict": 1})
    prompt = "".join(chr(t) for t in executor.prompts[-1])
    call_at = prompt.index('"name": "get_weather"')
    assert prompt.index('{"temp": -4}') > call_at and '"days": 3' in prompt
