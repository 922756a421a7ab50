"""Tool calls read out of streamed content (`tandem.server.call_stream`), in each format's
syntax (`tandem.server.tool_formats`): the content around the calls, each call's name and its
arguments, for model-like outputs; text that opens a section but holds no call stays content;
and any split of an output into pieces gives the same result as the whole (a property test)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.server.call_stream import Args, CallStream, Content, End, Start, value_end
from tandem.server.tool_formats import hermes, llama3, mistral

H, L, M = hermes.FORMAT.syntax, llama3.FORMAT.syntax, mistral.FORMAT.syntax
# Llama 3.1 with its built-in tools declared (all three; only brave_search)
LB = llama3.bind([{"function": {"name": n}} for n in llama3.BUILTIN])[0]
LS = llama3.bind([{"function": {"name": "brave_search"}}])[0]
WEATHER = '{"city": "Oslo", "days": 3}'

CASES = [
    # (syntax, output, content, [(name, arguments)])
    (H, f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "Let me look.", [("get_weather", WEATHER)]),
    (H, "no calls <tool_call>not json</tool_call>", "no calls <tool_call>not json</tool_call>", []),
    (H, "plain text, its framing kept  \n", "plain text, its framing kept  \n", []),
    (H, '<tool_call>{"arguments": {"a": [1, "}"]}, "name": "f"}</tool_call> after',
     "after", [("f", '{"a": [1, "}"]}')]),
    (H, '<tool_call>{"name": "f", "arguments": {"a": "x\\"}"}}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "", [("f", '{"a": "x\\"}"}'), ("g", "{}")]),
    (H, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    (H, '<tool_call>{"name": "f", "arguments": {"a": 1', "", [("f", '{"a": 1')]),  # cut short
    (L, f' {{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    (L, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     "", [("f", '{"x": 1}'), ("g", "{}")]),
    (L, '{"foo": 1} is only JSON', '{"foo": 1} is only JSON', []),
    (L, 'Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    (M, f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}, "id": "a1b2c3d4e"}}, '
        '{"name": "g", "arguments": {}}]', "", [("get_weather", WEATHER), ("g", "{}")]),
    (M, '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', "", [("f", '{"x": 1}'), ("g", "{}")]),
    (M, '[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": 1}', "", [("f", '{"x": 1}')]),
    (M, "text [TOOL_CALLS] nope", "text [TOOL_CALLS] nope", []),
    (LB, '<|python_tag|>brave_search.call(query="weather in \\"Oslo\\"")',
     "", [("brave_search", '{"query": "weather in \\"Oslo\\""}')]),
    (LB, "Let me check. <|python_tag|>wolfram_alpha.call(query='x^2 = 4', n=2)",
     "Let me check.", [("wolfram_alpha", '{"query": "x^2 = 4", "n": 2}')]),
    (LB, "<|python_tag|>\nimport math\nprint(math.pi)\n",
     "", [("code_interpreter", '{"code": "import math\\nprint(math.pi)"}')]),
    (LB, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}', "", [("f", '{"x": 1}')]),
    (LS, "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    (LS, 'a <|python_tag|>other.call(q="x")', 'a <|python_tag|>other.call(q="x")', []),
]  # fmt: skip


def read(syntax, pieces) -> tuple[str, list[tuple[str, str]], list]:
    stream = CallStream(syntax)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, Start):
            assert e.index == len(calls)  # names first, in order
            calls[e.index] = [e.name, ""]
        elif isinstance(e, Args):
            calls[e.index][1] += e.text
    ended = [e.index for e in events if isinstance(e, End)]
    assert ended == sorted(calls)  # every call ends, once
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [tuple(c) for c in calls.values()], events


@pytest.mark.parametrize("case", range(len(CASES)))
def test_model_like_outputs_read_into_content_and_calls(case):
    syntax, text, content, calls = CASES[case]
    got_content, got_calls, _ = read(syntax, [text])
    assert (got_content, got_calls) == (content, calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(range(len(CASES))), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_split_reads_as_the_whole(case, cuts):
    syntax, text, content, calls = CASES[case]
    at = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *at], [*at, len(text)])]
    assert read(syntax, pieces)[:2] == (content, calls)


def test_a_call_s_name_comes_before_its_arguments_end_and_arguments_stream_in_pieces():
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    _, _, events = read(H, list(text))  # one character at a time, as tokens could come
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "Start" and kinds[-1] == "End"
    assert kinds.count("Args") > 5  # the arguments as they are written, not at the end
    assert "".join(e.text for e in events if isinstance(e, Args)) == WEATHER


def test_value_end_finds_the_end_of_a_json_value_outside_strings():
    assert value_end('{"a": "}"} tail') == 10
    assert value_end('  ["]", [1]]x') == 12
    assert value_end('"a\\"b" rest') == 6
    assert value_end('{"a": 1') == -1
    assert value_end(', "id": "x"} more', depth=1) == 12
