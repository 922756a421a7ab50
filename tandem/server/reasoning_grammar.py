"""A chat's grammar (structured output, a forced tool call) held to the answer, the reasoning the
model writes before it left free. Without this a reasoning model under `response_format` could
not think at all, and gpt-oss would have to write JSON where its message header goes.

    think, the prompt outside <think>   start: (<think> REASONING </think> SPACE)? answer
    think, the prompt opened <think>    start: REASONING </think> SPACE answer
    harmony (prompt: <|start|>assistant)
                                        start: analysis? final
        analysis: <|channel|> "analysis" <|message|> REASONING <|end|> <|start|> "assistant"
        final:    <|channel|> "final" <|message|> answer <|return|>
        a forced call, for each tool:
                  <|channel|> "commentary to=functions.NAME " <|constrain|> "json" <|message|>
                  {arguments} <|call|>

`answer` is the request's own grammar (a JSON schema, or a Lark grammar's `start`). A marker is
its token where the tokenizer has it (`<[id]>`: the same characters written as text are
reasoning, not the marker), else its text (the reasoning then ends at the first `</think>` or
`<|end|>` written, as the parser reads it). A prompt that leaves the output elsewhere (no
reasoning format, a harmony prompt not ending in an assistant header) keeps the grammar as it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem.engine.grammar import GrammarSpec
from tandem.server import harmony
from tandem.server.reasoning import THINK_CLOSE, THINK_OPEN, Marker, Piece
from tandem.server.reasoning_format import ReasoningFormat
from tandem.server.tools import ToolPlan

# JSON as compact as the engine's own JSON grammars (`compile_grammar`)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPACE = "SPACE: /[ \\t\\r\\n]*/"
FREE_TEXT = "REASONING: /(.|\\n)*/"  # any text: a marker token ends it
UNTIL = "reasoning[stop={end}]: /(.|\\n)*/"  # text up to and with the end marker's text
_START_RULE = re.compile(r"^start(\s*:)", re.MULTILINE)


def chat_grammar(
    fmt: ReasoningFormat, spec: GrammarSpec | None, plan: ToolPlan | None, tail: list[Piece]
) -> GrammarSpec | None:
    """The grammar a chat's output is held to: a forced call's (in harmony's own form for a
    harmony model), else `spec` (None: none), after the reasoning."""
    if plan is not None and plan.grammar is not None:
        call = harmony_call(fmt, plan.tools, tail) if fmt.kind == "harmony" else None
        if call is not None:
            return call
        spec = plan.grammar
    return None if spec is None else hold_answer(fmt, spec, tail)


def hold_answer(fmt: ReasoningFormat, spec: GrammarSpec, tail: list[Piece]) -> GrammarSpec:
    """`spec` as the answer after the free reasoning of `fmt`, for an output that continues the
    prompt's `tail` (`ReasoningFormat.prompt_tail`)."""
    if fmt.kind == "think":
        inside = _last_marker(tail) == THINK_OPEN
        opened = "" if inside else f"{_tok(fmt, THINK_OPEN)} "
        head = f"{opened}{_until(fmt, THINK_CLOSE)} SPACE"
        start = f"start: {head} answer" if inside else f"start: thought? answer\nthought: {head}"
        return _lark(fmt, THINK_CLOSE, start, _answer_rules(spec))
    if fmt.kind == "harmony" and _in_assistant_header(tail):
        final = f'{_tok(fmt, harmony.CHANNEL)} "final" {_tok(fmt, harmony.MESSAGE)} answer'
        rules = f"final: {final} {_tok(fmt, harmony.RETURN)}\n{_answer_rules(spec)}"
        return _lark(fmt, harmony.END, "start: analysis? final", rules, _analysis(fmt))
    return spec


def harmony_call(
    fmt: ReasoningFormat, tools: list[dict[str, Any]], tail: list[Piece]
) -> GrammarSpec:
    """A forced call in harmony's form: one of `tools`, its arguments valid against the tool's
    parameters, after an optional analysis message; None for a prompt that does not end in an
    assistant header."""
    if not _in_assistant_header(tail):
        return None
    calls = []
    for k, t in enumerate(tools):
        fn = t["function"]
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": COMPACT_JSON}
        calls.append(
            f'call_{k}: {_tok(fmt, harmony.CHANNEL)} "commentary to=functions.{fn["name"]} " '
            f'{_tok(fmt, harmony.CONSTRAIN)} "json" {_tok(fmt, harmony.MESSAGE)} '
            f"%json {json.dumps(schema)} {_tok(fmt, harmony.CALL)}"
        )
    choice = " | ".join(f"call_{k}" for k in range(len(tools)))
    start = f"start: analysis? call\ncall: {choice}"
    return _lark(fmt, harmony.END, start, "\n".join(calls), _analysis(fmt))


def _analysis(fmt: ReasoningFormat) -> str:
    return (
        f'analysis: {_tok(fmt, harmony.CHANNEL)} "analysis" {_tok(fmt, harmony.MESSAGE)} '
        f'{_until(fmt, harmony.END)} {_tok(fmt, harmony.START)} "assistant"'
    )


def _answer_rules(spec: GrammarSpec) -> str:
    """The request's grammar as the rule `answer`."""
    if spec.kind == "lark":
        return _START_RULE.sub(r"answer\1", spec.text or "")
    schema = spec.schema if spec.schema is not None else {"type": "object"}
    return f"answer: %json {json.dumps({**schema, 'x-guidance': COMPACT_JSON})}"


def _lark(fmt: ReasoningFormat, end: str, *parts: str) -> GrammarSpec:
    """The grammar of `parts`, with the free reasoning that ends at `end`."""
    free = FREE_TEXT if fmt.ids else UNTIL.format(end=json.dumps(end))
    return GrammarSpec("lark", text="\n".join([*parts, free, SPACE]))


def _until(fmt: ReasoningFormat, end: str) -> str:
    """Free reasoning and the marker `end` that closes it."""
    return f"REASONING {_tok(fmt, end)}" if fmt.ids else "reasoning"


def _tok(fmt: ReasoningFormat, marker: str) -> str:
    """`marker` in Lark: its token by id, else its text."""
    token = fmt.token(marker)
    return f"<[{token}]>" if token is not None else json.dumps(marker)


def _last_marker(tail: list[Piece]) -> str | None:
    markers = [p.text for p in tail if isinstance(p, Marker)]
    return markers[-1] if markers else None


def _in_assistant_header(tail: list[Piece]) -> bool:
    """Whether the prompt ends in `<|start|>assistant`, the header the output goes on with."""
    if _last_marker(tail) != harmony.START or len(tail) != 2:
        return False
    role = tail[1]
    return isinstance(role, str) and role.strip() == "assistant"
