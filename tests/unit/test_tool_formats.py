"""Per-family tool-call formats (`tandem.server.tool_formats`) on the real chat templates of
Llama 3.x, Mistral (Nemo's array form, Small 3.2's `NAME[ARGS]` form), Qwen 2.5 / 3 and gpt-oss
(llama.cpp's copies of the models' own templates, models/templates/*.jinja, rendered in
tandem's template sandbox): each template picks its format; a past call, written by the
template itself, reads back through the format's call stream as the same call (so the parser
reads what the model was trained to write); a conversation with tandem's call ids renders (Mistral's
templates refuse ids that are not 9 letters and digits); and each format's forced-call grammar
takes exactly a call of the named tool in that format, which reads back as that call."""

import json

import pytest
from llamacpp_templates import template
from test_grammar_mask import VOCAB, _allowed_chars, _feed

from tandem.loaders.chat_template import TemplateRenderer
from tandem.server import tool_formats, tools
from tandem.server.call_stream import Args, CallStream, Content, Start
from tandem.server.tool_formats import ServedFormat, llama3

LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>"}
QWEN = {"bos_token": "", "eos_token": "<|im_end|>"}
# template file, the tokens it reads, the format auto picks, what ends an assistant turn
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct": (LLAMA, "llama3", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": (LLAMA, "llama3", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": (LLAMA, "llama3", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": (MISTRAL, "mistral", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": (MISTRAL, "mistral", "</s>"),
    "Qwen-Qwen2.5-7B-Instruct": (QWEN, "hermes", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (QWEN, "hermes", "<|im_end|>"),
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]  # fmt: skip
ARGS = {"city": "Oslo", "days": 3}
CALL = {
    "id": "call_5c0ffee5c0ffee5c0ffee5c0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
}


def read(syntax, text: str) -> tuple[str, list[tuple[str, dict]]]:
    stream = CallStream(syntax)
    events = stream.feed(text) + stream.finish()
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, Start):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, Args):
            calls[e.index][1] += e.text
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [(n, json.loads(a)) for n, a in calls.values()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_template_picks_its_format(family):
    assert tool_formats.choose(template(family), "none").name == FAMILIES[family][1]


def test_a_harmony_model_calls_in_harmony_and_a_name_overrides_the_template():
    assert tool_formats.choose(template("openai-gpt-oss-120b"), "harmony").name == "harmony"
    assert tool_formats.choose("", "none", "mistral").name == "mistral"
    assert tool_formats.choose("", "none").name == "hermes"
    with pytest.raises(tool_formats.ToolFormatError):
        tool_formats.choose("", "none", "xml")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_past_call_as_the_template_writes_it_reads_back_as_that_call(family):
    tokens, name, end = FAMILIES[family]
    served = ServedFormat(tool_formats.choose(template(family), "none"), {})
    renderer = TemplateRenderer(template(family), tokens, family)
    try:
        user = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
        said = [*user, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
        result = {"role": "tool", "tool_call_id": CALL["id"], "content": '{"temp": 3}'}
        render = lambda msgs, gen: renderer.render(  # noqa: E731
            tools.template_messages(msgs, TOOLS, True, served), gen, {"tools": TOOLS}
        )
        prompt, whole = render(user, True), render(said, False)
        assert whole.startswith(prompt)
        answer = whole[len(prompt) :].split(end)[0]
        assert read(served.format.syntax, answer)[1] == [("get_weather", ARGS)], answer
        # the call's result goes back after the call, with the same (mapped) id
        after = render([*said, result], True)
        assert "temp" in after[len(whole) - len(end) - 1 :]
        if name == "mistral":
            assert served.format.history_id(CALL["id"]) in after
    finally:
        renderer.close()


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_a_forced_call_s_grammar_takes_one_call_in_the_format_and_it_reads_back(name):
    fmt = tool_formats.choose("", "none", name)
    spec = ServedFormat(fmt, {}).call_grammar(TOOLS[:1])
    written = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'
        "\n</tool_call>",
        "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]',
    }[name]
    head, city = written.split('"city": "')
    mask = VOCAB.mask(spec)
    _feed(mask, head + '"city": "')
    assert _allowed_chars(mask) == {"P", "O"}  # only the schema's cities
    _feed(mask, city)
    assert _allowed_chars(mask) == {"EOS"}  # one call, then the end
    assert read(fmt.syntax, written) == ("", [("get_weather", ARGS)])


def test_a_format_s_marker_token_is_written_as_that_token_in_the_grammar():
    served = ServedFormat(tool_formats.choose("", "none", "mistral"), {7: "[TOOL_CALLS]"})
    assert served.call_grammar(TOOLS[:1]).text.startswith("start: <[7]> ")


def test_mistral_s_ids_are_nine_letters_and_digits_and_history_ids_map_stably():
    fmt = tool_formats.choose("", "none", "mistral")
    fresh = fmt.new_id()
    assert len(fresh) == 9 and fresh.isalnum() and fmt.history_id(fresh) == fresh
    mapped = fmt.history_id(CALL["id"])
    assert len(mapped) == 9 and mapped.isalnum() and mapped == fmt.history_id(CALL["id"])


# ---- Llama 3.1's built-in tools (brave_search, wolfram_alpha, code_interpreter) -----------------

BUILTIN = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for name, key in [("brave_search", "query"), ("wolfram_alpha", "query"),
                      ("code_interpreter", "code")]
]  # fmt: skip


def _renamed(tool: dict, old: str, new: str) -> dict:
    if tool["function"]["name"] != old:
        return tool
    return {**tool, "function": {**tool["function"], "name": new}}


def builtin_call(name: str, args: dict) -> dict:
    return {"id": "call_b", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip


@pytest.mark.parametrize(
    "family", ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.3-70B-Instruct"]
)
@pytest.mark.parametrize(
    "name,args",
    [
        ("brave_search", {"query": "weather in Oslo"}),
        ("wolfram_alpha", {"query": "2^10"}),
        ("web_search", {"query": "weather in Oslo"}),  # llama.cpp's alias of brave_search
    ],
)
def test_a_builtin_call_as_meta_s_template_writes_it_reads_back_and_its_result_is_ipython(
    family, name, args
):
    meta = llama3.ALIASES.get(name, name)  # the name the template and the model know
    offered = [*TOOLS, *(_renamed(t, meta, name) for t in BUILTIN)]
    variables: dict = {}
    served = tools.for_request(
        ServedFormat(tool_formats.choose(template(family), "none"), {}), offered, variables,
        lambda v: v == "builtin_tools",
    )  # fmt: skip
    assert variables == {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]}
    renderer = TemplateRenderer(template(family), LLAMA, family)
    try:
        render = lambda msgs, gen: renderer.render(  # noqa: E731
            tools.template_messages(msgs, offered, True, served), gen,
            {"tools": offered, **variables},
        )  # fmt: skip
        user = [{"role": "user", "content": "Look it up."}]
        prompt = render(user, True)
        assert "Environment: ipython\nTools: brave_search, wolfram_alpha\n" in prompt
        said = [
            *user,
            {"role": "assistant", "content": "", "tool_calls": [builtin_call(name, args)]},
        ]
        whole = render(said, False)
        answer = whole[len(prompt) :]
        assert answer.startswith(f"<|python_tag|>{meta}.call(") and answer.endswith("<|eom_id|>")
        assert read(served.format.syntax, answer.removesuffix("<|eom_id|>"))[1] == [(name, args)]
        # unbound (no built-in tool in the request), the same text is no call
        plain = tool_formats.choose(template(family), "none").syntax
        assert read(plain, answer.removesuffix("<|eom_id|>"))[1] == []
        for role in ("tool", "ipython"):
            result = {"role": role, "tool_call_id": "call_b", "content": "12 degrees"}
            after = render([*said, result], True)[len(whole) :]
            # (Meta's template writes a string result as JSON: strings are iterable in Jinja)
            assert after.startswith('<|start_header_id|>ipython<|end_header_id|>\n\n"12 degrees"')
    finally:
        renderer.close()


def test_raw_code_after_the_python_tag_is_a_code_interpreter_call_only_where_declared():
    code = "import math\nprint(math.sqrt(2))\n"
    fmt = tool_formats.choose("", "none", "llama3")
    bound = ServedFormat(fmt, {}).for_tools(BUILTIN)[0].format.syntax
    assert read(bound, "<|python_tag|>" + code) == (
        "",
        [("code_interpreter", {"code": code.rstrip()})],
    )
    searching = ServedFormat(fmt, {}).for_tools(BUILTIN[:1])[0].format.syntax
    assert read(searching, "<|python_tag|>" + code) == ("<|python_tag|>" + code, [])
    # a call of a tool not declared, or one that is not a literal call, stays content
    for text in [
        '<|python_tag|>wolfram_alpha.call(query="x")',
        "<|python_tag|>brave_search.call(q=f())",
    ]:
        assert read(searching, text)[1] == []
