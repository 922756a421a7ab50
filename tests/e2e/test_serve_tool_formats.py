"""Tool calls in Llama 3's and Mistral's formats through a live `tandem serve` and the official
`openai` client: random-weight tiny-llama / tiny-mistral models carrying Meta's Llama 3.1 and
Mistral Nemo's real chat templates (llama.cpp's copies) and those families' marker tokens
(`<|python_tag|>`, `[TOOL_CALLS]` as special tokens). The server picks the format from the
template; a forced call (named, and `required`) comes back as `tool_calls` whose arguments
validate, whole and streamed as deltas; the call's result goes back through the template with
the call's id (Mistral's template refuses ids that are not 9 letters and digits)."""

import json

import jsonschema
import llamacpp_templates
import openai
import pytest
from reasoning_models import write_model
from serve_support import running

FAMILIES = {
    # preset, template, special tokens, end-of-turn tokens
    "llama3": (
        "tiny-llama",
        "meta-llama-Llama-3.1-8B-Instruct",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"],
        ["<|eot_id|>", "<|eom_id|>"],
    ),
    "mistral": (
        "tiny-mistral",
        "mistralai-Mistral-Nemo-Instruct-2407",
        ["</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        ["</s>"],
    ),
}  # fmt: skip
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def server(request, tmp_path_factory):
    preset, template, special, eos = FAMILIES[request.param]
    path = llamacpp_templates.path(template)
    model = write_model(
        tmp_path_factory.mktemp(preset) / preset, preset, special, [], path.read_text(), eos, 4096
    )
    with running(["serve", "--model", str(model), "--max-seq-len", "4096"]) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield request.param, client, client.models.list().data[0].id


def test_forced_calls_come_back_in_the_family_s_format_and_validate(server):
    family, client, name = server
    messages = [{"role": "user", "content": "Weather in Lima?"}]
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = client.chat.completions.create(model=name, messages=messages, tools=TOOLS,
                                           tool_choice=choice, temperature=1.0, seed=4,
                                           max_tokens=120)  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert not r.choices[0].message.content
        if family == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
    # the result goes back through the template, the call's id with it
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'},
    ]
    after = client.chat.completions.create(
        model=name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert after.choices[0].finish_reason in ("stop", "length")


def test_a_streamed_forced_call_comes_as_deltas(server):
    _, client, name = server
    forced = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(
        client.chat.completions.create(
            model=name,
            tools=TOOLS,
            tool_choice=forced,
            stream=True,
            messages=[{"role": "user", "content": "Time?"}],
            temperature=1.0,
            seed=9,
            max_tokens=120,
        )  # fmt: skip
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # no marker, no call text
    pieces = [t for d in deltas for t in d.tool_calls or []]
    assert pieces[0].function.name == "get_time" and pieces[0].id
    arguments = "".join(t.function.arguments or "" for t in pieces)
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
