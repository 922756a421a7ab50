"""Which tool-call format a served model writes, one small module per format, chosen from its
chat template (or named with `--tool-call-parser`):

    format    chosen when                                   a call is written
    mistral   the template writes `[TOOL_CALLS]`            [TOOL_CALLS][{"name": .., "arguments": {..}}, ..]
                                                            or [TOOL_CALLS]NAME[ARGS]{..} (newer)
    llama3    the template writes `<|python_tag|>`, or      {"name": .., "parameters": {..}} as the whole
              `"parameters"` and the `ipython` role         answer (<|python_tag|> may lead; `;` between)
    harmony   the model writes harmony (gpt-oss)            <|channel|>commentary to=functions.NAME ..
                                                            (read by `tandem.server.harmony`)
    hermes    otherwise (Qwen, SmolLM2, ...)                <tool_call>{"name": .., "arguments": {..}}</tool_call>

Each module gives its `CallSyntax` (how `call_stream` reads the calls out of the content), the
grammar a forced call is held to (one call of one of the tools, its arguments valid against
that tool's parameters), its call ids, and where a request's tools change how calls are read
and what the template gets (Llama 3.1's built-in tools), its `bind`. A format's marker that is one token of the served
tokenizer (`[TOOL_CALLS]`, `<|python_tag|>`: special tokens that decoding would drop) is kept in
the text while tools are in play, and written as that token in the grammar.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.engine.grammar import GrammarSpec
from tandem.server.call_stream import CallSyntax

# a forced call's JSON: no free whitespace (a small model left free to indent wanders)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHOICES = ("auto", "hermes", "llama3", "mistral", "harmony")


class ToolFormatError(ValueError):
    """A --tool-call-parser value tandem does not know."""


Literal = Callable[[str], str]  # a marker -> its Lark form (its token `<[id]>`, else its text)
# a request's tools -> the syntax its calls are read with, the template variables they set, and
# the names past calls take in the template (a declared name -> the one the model knows)
Bind = Callable[[list[dict[str, Any]]], tuple[CallSyntax, dict[str, Any], dict[str, str]]]


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call format: `syntax` for reading calls, `grammar(tools, literal)` the Lark text of
    a forced call (None: harmony's, built with its reasoning in `reasoning_grammar`), `markers`
    that may be tokens, `new_id()` a fresh call id, `history_id(id)` the id a template reads,
    `history_name(name)` the name a past call has there, `bind(tools)` the syntax, template
    variables and past calls' names for a request's tools (None: `syntax`, none, as declared)."""

    name: str
    syntax: CallSyntax
    grammar: Callable[[list[dict[str, Any]], Literal], str] | None
    markers: tuple[str, ...] = ()
    new_id: Callable[[], str] = field(default=lambda: f"call_{uuid.uuid4().hex[:24]}")
    history_id: Callable[[str], str] = field(default=lambda i: i)
    history_name: Callable[[str], str] = field(default=lambda n: n)
    bind: Bind | None = None


@dataclass(frozen=True)
class ServedFormat:
    """A format bound to the served tokenizer: `ids` its markers that are single tokens."""

    format: ToolFormat
    ids: dict[int, str]

    @property
    def name(self) -> str:
        return self.format.name

    def call_grammar(self, tools: list[dict[str, Any]]) -> GrammarSpec | None:
        """The grammar of one call of one of `tools` (None: the format builds it elsewhere)."""
        if self.format.grammar is None:
            return None
        return GrammarSpec("lark", text=self.format.grammar(tools, self._literal))

    def for_tools(self, tools: list[dict[str, Any]] | None) -> tuple[ServedFormat, dict[str, Any]]:
        """This format as a request with `tools` reads its calls, and the template variables
        those tools set (Llama 3.1's `builtin_tools`)."""
        if not tools or self.format.bind is None:
            return self, {}
        syntax, variables, names = self.format.bind(tools)
        fmt = replace(self.format, syntax=syntax, history_name=lambda n: names.get(n, n))
        return ServedFormat(fmt, self.ids), variables

    def _literal(self, marker: str) -> str:
        token = next((i for i, m in self.ids.items() if m == marker), None)
        return f"<[{token}]>" if token is not None else json.dumps(marker)


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call object `{"name": NAME, args_key: {...}}` of one of `tools`,
    the arguments valid against that tool's parameters, written compactly."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                args_key: t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"anyOf": options, "x-guidance": COMPACT_JSON}


def choose(template: str, reasoning: str, name: str = "auto") -> ToolFormat:
    """The format `name` names, or (auto) the one the chat `template` source writes; a model whose
    reasoning format is harmony calls in harmony."""
    from tandem.server.tool_formats import harmony, hermes, llama3, mistral

    table = {f.FORMAT.name: f for f in (mistral, llama3, harmony, hermes)}
    if name not in CHOICES:
        raise ToolFormatError(f"--tool-call-parser {name!r}: not one of {', '.join(CHOICES)}")
    if name != "auto":
        return table[name].FORMAT
    if reasoning == "harmony":
        return harmony.FORMAT
    found = next((f for f in (mistral, llama3) if f.writes(template)), hermes)
    return found.FORMAT


def serve(fmt: ToolFormat, tokenizer: Any) -> ServedFormat:
    """`fmt` bound to `tokenizer`: its markers that are single tokens there."""
    find = getattr(tokenizer, "token_id", None)
    ids = {}
    for m in fmt.markers:
        token = find(m) if callable(find) else None
        if token is not None:
            ids[token] = m
    return ServedFormat(fmt, ids)
