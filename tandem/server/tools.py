"""Tool calls in the Qwen / Hermes format: the request's `tools` and `tool_choice`, the messages
as a chat template reads them, the grammar a forced call is held to, and the model's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks parsed into OpenAI's
`tool_calls`.

    tool_choice   the prompt gets     the output is          finish_reason with a call
    none          no tools            free text              -
    auto          the tools           free text, parsed      "tool_calls"
    required      the tools           one call (grammar)     "tool_calls"
    {function}    that tool only      one call to it         "tool_calls"

A template that takes `tools` itself (Qwen's: its source names them) gets them as transformers
passes them (`tools=` in its context, assistant `tool_calls` with arguments as objects, `role:
tool` messages as they are). One that does not (SmolLM2's) gets the Hermes system prompt that
lists them, assistant calls written as `<tool_call>` blocks in the content and tool results as
`<tool_response>` user turns, the form such models are trained on."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.engine.grammar import GrammarSpec
from tandem.server.protocol import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# a forced call's JSON: no free whitespace (a small model left free to indent wanders)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the "
    "user query. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call, return a json object with the function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of a generation: `tools` for the prompt (OpenAI's shape),
    `grammar` a forced call's (None: free text), `parse` whether the output is read for calls."""

    tools: list[dict[str, Any]]
    grammar: GrammarSpec | None
    parse: bool


def plan(tools: list[dict[str, Any]] | None, choice: Any) -> ToolPlan | None:
    """The plan for `tools` and `tool_choice` (None: no tools in play); a 400 naming the field
    for a tool or choice tandem cannot read."""
    if not tools or choice == "none":
        if choice not in (None, "none", "auto"):
            raise APIError(
                400, "`tool_choice` names a tool but `tools` is empty", param="tool_choice"
            )
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}]: only function tools are supported", param="tools")
        if not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise APIError(
                400, f"tools[{i}]: a function needs a name of [A-Za-z0-9_.-]", param="tools"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}]: parameters must be a JSON schema", param="tools")
    if choice in (None, "auto"):
        return ToolPlan(tools, None, True)
    if choice == "required":
        return ToolPlan(tools, call_grammar(tools), True)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise APIError(
            400, f"`tool_choice` names no tool in `tools`: {choice!r}", param="tool_choice"
        )
    return ToolPlan(chosen, call_grammar(chosen), True)


def call_grammar(tools: list[dict[str, Any]]) -> GrammarSpec:
    """One `<tool_call>` block whose JSON names one of `tools` and whose arguments validate
    against that tool's parameters."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"anyOf": options, "x-guidance": COMPACT_JSON}
    lark = f'start: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"\ncall: %json {json.dumps(schema)}'
    return GrammarSpec("lark", text=lark)


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
) -> list[dict[str, Any]]:
    """`messages` as the template reads them: arguments as objects for a template that takes
    tools (`native`); for one that does not, the Hermes forms (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if native:
            if calls:
                m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
            out.append(m)
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": text})
        elif calls:
            blocks = [f"{CALL_OPEN}\n{json.dumps(_call_json(c))}\n{CALL_CLOSE}" for c in calls]
            content = "\n".join([*([m["content"]] if m.get("content") else []), *blocks])
            out.append({"role": m["role"], "content": content})
        else:
            out.append(m)
    if tools and not native:
        listed = "\n".join(json.dumps(t) for t in tools)
        system = HERMES_SYSTEM.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content outside the calls or None, OpenAI's `tool_calls`) of a model's output; a
    block that is not a JSON object with a name stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for block in CALL_BLOCK.finditer(text):
        try:
            obj = json.loads(block.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last : block.start()])
        last = block.end()
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    fn["arguments"] = _arguments(fn.get("arguments"))
    return {**call, "function": fn}


def _arguments(value: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates (transformers') read an object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
