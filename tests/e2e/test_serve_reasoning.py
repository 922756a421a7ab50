"""Reasoning apart from the answer through a live `tandem serve` and the official clients, on two
random-weight models whose tokenizers have the formats' marker tokens (`reasoning_models.py`):
gpt-oss's layout writing harmony, and Qwen3's with `<think>` under a template that opens it.

The models are steered with request features only: a `response_format` schema or a required tool
(held after the reasoning by the server's grammar), `logit_bias` on the first token of
"analysis" (+100) and on the reasoning's closing marker (+60) with `frequency_penalty` 2, so the
reasoning runs a few tokens and then closes. Each answer is checked against the tokens the model
wrote (its logprobs' tokens, markers included): reasoning_content / thinking is the reasoning's
text, content the answer's, streamed or not, and no marker reaches either."""

import json

import jsonschema
import ollama
import openai
import pytest
from reasoning_models import harmony_model, think_model
from serve_support import running_all
from tokenizers import Tokenizer

NUMBER = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Pick a number."}]
MARKERS = ("<|", "<think>", "</think>")


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def steering(model, closing: str) -> dict:
    """The request fields that make the random model reason a few tokens, then close."""
    ids = Tokenizer.from_file(str(model / "tokenizer.json"))
    bias = {ids.encode("analysis").ids[0]: 100, ids.token_to_id(closing): 60}
    return {"logit_bias": {str(k): v for k, v in bias.items()}, "frequency_penalty": 2.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The three servers this module asks, started together: gpt-oss's harmony model, Qwen3's
    `<think>` model, and the latter under `--reasoning-parser none`; (models, base URLs)."""
    harmony = harmony_model(tmp_path_factory.mktemp("harmony") / "gpt-oss-harmony")
    think = think_model(tmp_path_factory.mktemp("think") / "qwen3-think")
    args = (
        ["serve", "--model", str(harmony)],
        ["serve", "--model", str(think)],
        ["serve", "--model", str(think), "--reasoning-parser", "none"],
    )
    with running_all(*args) as up:
        yield (harmony, think), [base for _, base in up]


@pytest.fixture(scope="module")
def gpt_oss(served):
    (model, _), (base, _, _) = served
    return openai_client(base), steering(model, "<|end|>")


@pytest.fixture(scope="module")
def qwen_think(served):
    (_, model), (_, base, _) = served
    return base, openai_client(base), steering(model, "</think>"), model


def streamed(client, **kw) -> tuple[str, str, list, str]:
    """(reasoning, content, tool_calls deltas, finish_reason) of a streamed chat; no delta's text
    holds a marker."""
    reasoning = content = ""
    calls, finish = [], None
    for event in client.chat.completions.create(**kw, stream=True):
        for choice in event.choices:
            d = choice.delta
            part = getattr(d, "reasoning_content", None) or ""
            assert not any(m in part + (d.content or "") for m in MARKERS), d
            reasoning += part
            content += d.content or ""
            calls += d.tool_calls or []
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def written(choice) -> str:
    """What the model wrote, markers included: its logprobs' tokens."""
    return "".join(t.token for t in choice.logprobs.content)


def test_harmony_reasoning_and_answer_come_apart_streamed_and_not(gpt_oss):
    client, steer = gpt_oss
    fmt = {"type": "json_schema", "json_schema": {"name": "number", "schema": NUMBER}}
    kw = dict(model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=80)
    kw.update(response_format=fmt, extra_body=steer)
    choice = client.chat.completions.create(**kw, logprobs=True).choices[0]
    reasoning, content = choice.message.reasoning_content, choice.message.content
    assert choice.finish_reason == "stop" and reasoning
    jsonschema.validate(json.loads(content), NUMBER)
    assert written(choice) == (
        f"<|channel|>analysis<|message|>{reasoning}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{content}"
    )
    assert streamed(client, **kw) == (reasoning, content, [], "stop")


def test_a_required_tool_on_harmony_is_called_in_its_form_and_returned_as_tool_calls(gpt_oss):
    client, steer = gpt_oss
    kw = dict(model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=200)
    kw.update(tools=TOOLS, tool_choice="required", extra_body=steer)
    choice = client.chat.completions.create(**kw, logprobs=True).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_weather" and choice.message.reasoning_content
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert written(choice) == (
        f"<|channel|>analysis<|message|>{choice.message.reasoning_content}<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{call.function.arguments}"
    )
    reasoning, content, calls, finish = streamed(client, **kw)
    assert (reasoning, content, finish) == (choice.message.reasoning_content, "", "tool_calls")
    (delta,) = calls
    assert delta.index == 0 and delta.function.arguments == call.function.arguments


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_elsewhere(
    gpt_oss, qwen_think
):
    client, _ = gpt_oss
    kw = dict(model=client.models.list().data[0].id, messages=ASK, max_tokens=2)
    plain = client.chat.completions.create(**kw).usage.prompt_tokens
    assert client.chat.completions.create(**kw, reasoning_effort="high").usage.prompt_tokens > plain
    _, other, _, _ = qwen_think
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        other.chat.completions.create(
            model=other.models.list().data[0].id, messages=ASK, max_tokens=2, reasoning_effort="low"
        )


def test_think_reasoning_from_a_template_that_opens_it_comes_apart_streamed_and_not(qwen_think):
    _, client, steer, _ = qwen_think
    fmt = {"type": "json_schema", "json_schema": {"name": "number", "schema": NUMBER}}
    kw = dict(model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=80)
    kw.update(response_format=fmt, extra_body=steer)
    choice = client.chat.completions.create(**kw, logprobs=True).choices[0]
    reasoning, content = choice.message.reasoning_content, choice.message.content
    assert choice.finish_reason == "stop" and reasoning
    jsonschema.validate(json.loads(content), NUMBER)
    before, after = written(choice).split("</think>")  # the template wrote <think>
    assert (reasoning, content) == (before.strip(), after.lstrip())
    assert streamed(client, **kw) == (reasoning, content, [], "stop")


def test_ollama_thinking_is_the_openai_reasoning_and_think_false_turns_it_off(qwen_think):
    base, client, _, _ = qwen_think
    name = client.models.list().data[0].id
    o = ollama.Client(host=base, timeout=120)
    greedy = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 12}
    want = client.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=12)
    want = want.choices[0].message
    assert want.reasoning_content  # the template opened <think>: the answer starts in it
    got = o.chat(model=name, messages=ASK, options=greedy).message
    assert (got.thinking, got.content) == (want.reasoning_content, want.content)
    parts = list(o.chat(model=name, messages=ASK, options=greedy, stream=True))
    thinking = "".join(p.message.thinking or "" for p in parts)
    assert (thinking, "".join(p.message.content for p in parts)) == (got.thinking, got.content)
    off = o.chat(model=name, messages=ASK, options=greedy, think=False).message
    plain = client.chat.completions.create(
        model=name, messages=ASK, temperature=0, max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0].message  # fmt: skip
    assert off.thinking is None and plain.reasoning_content is None
    assert off.content == plain.content and plain.content
    assert "thinking" in o.show(name).capabilities
    gen = o.generate(model=name, prompt=ASK[0]["content"], options=greedy)  # one user turn
    assert (gen.thinking, gen.response) == (got.thinking, got.content)
    with pytest.raises(ollama.ResponseError, match="raw"):
        o.generate(model=name, prompt="x", raw=True, think=True)


def test_reasoning_parser_none_leaves_the_text_as_the_model_wrote_it(served):
    _, (_, _, base) = served  # the think model under `--reasoning-parser none`
    client = openai_client(base)
    kw = dict(model=client.models.list().data[0].id, messages=ASK, temperature=0)
    choice = client.chat.completions.create(**kw, max_tokens=12, logprobs=True).choices[0]
    assert choice.message.content == written(choice)
    assert getattr(choice.message, "reasoning_content", None) is None
    with pytest.raises(ollama.ResponseError, match="does not support thinking"):
        ollama.Client(host=base, timeout=120).chat(model=kw["model"], messages=ASK, think=True)
