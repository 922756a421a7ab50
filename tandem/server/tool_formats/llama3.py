"""Llama 3.1 / 3.2 / 3.3 tool calls. A function call is the answer, a bare JSON object

    {"name": "get_weather", "parameters": {"city": "Paris"}}

as Meta's templates write past calls and ask for new ones (`<|python_tag|>` may lead; calls
after the first follow a `;`). Llama 3.1's built-in tools, where a request declares a function
of that name (`brave_search`, `wolfram_alpha`, `code_interpreter`) or of llama.cpp's alias for
it (`web_search` for `brave_search`, `python` for `code_interpreter`), are named to the
template as `builtin_tools` under Meta's names (its system turn then says `Environment: ipython`
and lists them) and their calls read in the form the model writes them, one per answer, after
`<|python_tag|>`, returned under the name the request declared:

    <|python_tag|>brave_search.call(query="weather in Paris")   -> brave_search {"query": ...}
    <|python_tag|>import math\\nprint(math.pi)                   -> code_interpreter {"code": ...}

(keyword arguments with Python or JSON literal values, read by `ast`, never run; the alias's
own name, `web_search.call(...)`, read too; raw code only where the code interpreter is
declared). A forced call (`required`, or `tool_choice` naming it) of a built-in is held to that
form: `<|python_tag|>brave_search.call(k=V, ...)`, every parameter in declared order, each V JSON
valid against its schema, and `<|python_tag|>` then code for the code interpreter; the other
tools' calls to the JSON object. Tool results go back as the `ipython` role (the template maps
`role: tool` to it; a request may also send `role: ipython`)."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tandem.server.call_stream import CallSyntax
from tandem.server.tool_formats import COMPACT_JSON, Literal, ToolFormat, call_schema

PYTHON_TAG = "<|python_tag|>"
BUILTIN = ("brave_search", "wolfram_alpha", "code_interpreter")
CODE = "code_interpreter"
ALIASES = {"web_search": "brave_search", "python": "code_interpreter"}  # llama.cpp's names
JSON_LITERALS = {"true": True, "false": False, "null": None}


def grammar(tools: list[dict[str, Any]], literal: Literal) -> str:
    """The answer is one call: a built-in's in its dotted form (Meta's name), any other tool's
    as the call object, `parameters` holding the arguments."""
    builtins = builtin_names(tools)
    declared = set(builtins.values())
    plain = [t for t in tools if _name(t) not in declared]
    rules, options = [], []
    if plain:
        rules.append(f"json_call: %json {json.dumps(call_schema(plain, 'parameters'))}")
        options.append("json_call")
    tag = literal(PYTHON_TAG)
    by_name = {_name(t): t for t in tools}
    for k, (meta, name) in enumerate(builtins.items()):
        if meta == CODE:
            rules.append(f"b{k}: {tag} CODE{k}")
            rules.append(f"CODE{k}: /(.|\\n)+/")
        else:
            params = by_name[name]["function"].get("parameters") or {}
            args = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                value = {**schema, "x-guidance": COMPACT_JSON}
                rules.append(f"b{k}_{j}: %json {json.dumps(value)}")
                args.append(f"{json.dumps(key + '=')} b{k}_{j}")
            inner = ' ", " '.join(args) if args else ""
            rules.append(f'b{k}: {tag} {json.dumps(meta + ".call(")} {inner} ")"')
        options.append(f"b{k}")
    return "\n".join([f"start: {' | '.join(options)}", *rules])


def _name(tool: dict[str, Any]) -> str | None:
    return (tool.get("function") or {}).get("name")


def writes(template: str) -> bool:
    return PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template)


def builtin_names(tools: list[dict[str, Any]]) -> dict[str, str]:
    """The built-in tools among `tools`: Meta's name -> the name the request declared (Meta's
    own, or llama.cpp's alias; the first declared where both are), in Meta's order."""
    declared: dict[str, str] = {}
    for t in tools:
        name = _name(t)
        meta = ALIASES.get(name, name) if isinstance(name, str) else None
        if meta in BUILTIN:
            declared.setdefault(meta, name)  # type: ignore[arg-type]
    return {m: declared[m] for m in BUILTIN if m in declared}


def read_builtin(names: dict[str, str]) -> Callable[[str], list[tuple[str, str]] | None]:
    """A reader of the text after `<|python_tag|>` that is no JSON: `NAME.call(k=v, ...)` for a
    built-in's Meta name or its declared one, else (with the code interpreter declared) raw
    code; None for neither. `names`: Meta's name -> the declared one, the name returned."""
    declared = {d: d for d in names.values()}
    written = {**declared, **names}

    def read(text: str) -> list[tuple[str, str]] | None:
        call = dotted_call(text, tuple(written))
        if call is not None:
            return [(written[call[0]], call[1])]
        code = text.rstrip()
        if CODE in names and code:
            return [(names[CODE], json.dumps({"code": code}))]
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
        args = {k.arg: _literal(k.value) for k in node.keywords}  # type: ignore[union-attr]
        return f.value.id, json.dumps(args)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def _literal(node: ast.expr) -> Any:
    """A keyword's value: a Python literal, or JSON's `true`, `false`, `null` (a forced call's
    values are JSON)."""
    if isinstance(node, ast.Name) and node.id in JSON_LITERALS:
        return JSON_LITERALS[node.id]
    if isinstance(node, (ast.List, ast.Dict)):  # JSON's literals may sit inside
        return ast.literal_eval(_python_literals(node))
    return ast.literal_eval(node)


def _python_literals(node: ast.expr) -> ast.expr:
    class Swap(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            if n.id in JSON_LITERALS:
                return ast.copy_location(ast.Constant(JSON_LITERALS[n.id]), n)
            return n

    return Swap().visit(node)


def bind(tools: list[dict[str, Any]]) -> tuple[CallSyntax, dict[str, Any], dict[str, str]]:
    """With built-in tools declared: their calls read too, the template told of them under
    Meta's names, and a past call of an alias written under Meta's name (so the template writes
    it in the dotted form the model knows)."""
    names = builtin_names(tools)
    if not names:
        return SYNTAX, {}, {}
    rename = {declared: meta for meta, declared in names.items() if declared != meta}
    return replace(SYNTAX, whole=read_builtin(names)), {"builtin_tools": list(names)}, rename


SYNTAX = CallSyntax(openers=(PYTHON_TAG,), at_start=True, seps=";")
FORMAT = ToolFormat("llama3", SYNTAX, grammar, markers=(PYTHON_TAG,), bind=bind)
