"""Llama 3.1 / 3.2 / 3.3 tool calls. A function call is the answer, a bare JSON object

    {"name": "get_weather", "parameters": {"city": "Paris"}}

as Meta's templates write past calls and ask for new ones (`<|python_tag|>` may lead; calls
after the first follow a `;`). Llama 3.1's built-in tools, where a request declares a function
of that name (`brave_search`, `wolfram_alpha`, `code_interpreter`), are named to the template
as `builtin_tools` (its system turn then says `Environment: ipython` and lists them) and their
calls read in the form the model writes them, one per answer, after `<|python_tag|>`:

    <|python_tag|>brave_search.call(query="weather in Paris")   -> brave_search {"query": ...}
    <|python_tag|>import math\\nprint(math.pi)                   -> code_interpreter {"code": ...}

(keyword arguments with Python literal values, read by `ast`, never run; raw code only where
`code_interpreter` is declared). Tool results go back as the `ipython` role (the template maps
`role: tool` to it; a request may also send `role: ipython`)."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tandem.server.call_stream import CallSyntax
from tandem.server.tool_formats import Literal, ToolFormat, call_schema

PYTHON_TAG = "<|python_tag|>"
BUILTIN = ("brave_search", "wolfram_alpha", "code_interpreter")
CODE = "code_interpreter"


def grammar(tools: list[dict[str, Any]], literal: Literal) -> str:
    """The answer is one call object, `parameters` holding the arguments."""
    return f"start: %json {json.dumps(call_schema(tools, 'parameters'))}"


def writes(template: str) -> bool:
    return PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template)


def builtin_names(tools: list[dict[str, Any]]) -> list[str]:
    """The built-in tools among `tools` (function tools named as Meta names them), in Meta's
    order."""
    declared = {(t.get("function") or {}).get("name") for t in tools}
    return [n for n in BUILTIN if n in declared]


def read_builtin(names: Sequence[str]) -> Callable[[str], list[tuple[str, str]] | None]:
    """A reader of the text after `<|python_tag|>` that is no JSON: `NAME.call(k=v, ...)` for
    a declared NAME, else (with `code_interpreter` declared) raw code; None for neither."""

    def read(text: str) -> list[tuple[str, str]] | None:
        call = dotted_call(text, names)
        if call is not None:
            return [call]
        code = text.rstrip()
        if CODE in names and code:
            return [(CODE, json.dumps({"code": code}))]
        return None

    return read


def dotted_call(text: str, names: Sequence[str]) -> tuple[str, str] | None:
    """`NAME.call(k=v, ...)` (NAME one of `names`, each v a Python literal) as (NAME, the
    arguments as a JSON object's text); None for any other text."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    f = node.func if isinstance(node, ast.Call) else None
    if not (
        isinstance(f, ast.Attribute)
        and f.attr == "call"
        and isinstance(f.value, ast.Name)
        and f.value.id in names
        and not node.args  # type: ignore[union-attr]
        and all(k.arg for k in node.keywords)  # type: ignore[union-attr]
    ):
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}  # type: ignore[union-attr]
        return f.value.id, json.dumps(args)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def bind(tools: list[dict[str, Any]]) -> tuple[CallSyntax, dict[str, Any]]:
    """With built-in tools declared: their calls read too, and the template told of them."""
    names = builtin_names(tools)
    if not names:
        return SYNTAX, {}
    return replace(SYNTAX, whole=read_builtin(tuple(names))), {"builtin_tools": names}


SYNTAX = CallSyntax(openers=(PYTHON_TAG,), at_start=True, seps=";")
FORMAT = ToolFormat("llama3", SYNTAX, grammar, markers=(PYTHON_TAG,), bind=bind)
