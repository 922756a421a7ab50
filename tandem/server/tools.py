"""Tool calls: the request's `tools` and `tool_choice`, the messages as a chat template reads
them, and the grammar a forced call is held to, in the served model's format
(`tandem.server.tool_formats`; the calls are read out of the output by `call_stream`).

    tool_choice   the prompt gets     the output is          finish_reason with a call
    none          no tools            free text              -
    auto          the tools           free text, parsed      "tool_calls"
    required      the tools           one call (grammar)     "tool_calls"
    {function}    that tool only      one call to it         "tool_calls"

A template that takes `tools` itself (Qwen's: its source names them) gets them as transformers
passes them (`tools=` in its context, assistant `tool_calls` with arguments as objects, `role:
tool` messages as they are). One that does not (SmolLM2's) gets the Hermes system prompt that
lists them, assistant calls written as `<tool_call>` blocks in the content and tool results as
`<tool_response>` user turns, the form such models are trained on. A result sent as Llama's
`role: ipython` is a `role: tool` one for every other format."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.grammar import GrammarSpec
from tandem.server.protocol import APIError
from tandem.server.tool_formats import ServedFormat, hermes

CALL_OPEN, CALL_CLOSE = hermes.OPEN, hermes.CLOSE
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
HERMES = ServedFormat(hermes.FORMAT, {})
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


def plan(
    tools: list[dict[str, Any]] | None, choice: Any, served: ServedFormat = HERMES
) -> ToolPlan | None:
    """The plan for `tools` and `tool_choice` (None: no tools in play), a forced call in the
    `served` format; a 400 naming the field for a tool or choice tandem cannot read."""
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
        return ToolPlan(tools, served.call_grammar(tools), True)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise APIError(
            400, f"`tool_choice` names no tool in `tools`: {choice!r}", param="tool_choice"
        )
    return ToolPlan(chosen, served.call_grammar(chosen), True)


def for_request(
    served: ServedFormat,
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
    reads: Callable[[str], bool],
) -> ServedFormat:
    """`served` as a request offering `tools` reads its calls; the variables those tools set
    (Llama 3.1's `builtin_tools`) added to `variables` where the template reads them and the
    request's `chat_template_kwargs` did not set them."""
    bound, extra = served.for_tools(tools)
    for name, value in extra.items():
        if reads(name):
            variables.setdefault(name, value)
    return bound


def call_grammar(tools: list[dict[str, Any]]) -> GrammarSpec:
    """One `<tool_call>` block whose JSON names one of `tools` and whose arguments validate
    against that tool's parameters (the Hermes format's forced call)."""
    spec = HERMES.call_grammar(tools)
    assert spec is not None
    return spec


def template_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    native: bool,
    served: ServedFormat = HERMES,
) -> list[dict[str, Any]]:
    """`messages` as the template reads them: arguments as objects and call ids as the
    `served` format's template takes them (Mistral's: 9 letters and digits), and call names as
    it knows them (Llama 3.1's built-ins under Meta's names), for a template that takes tools
    (`native`); for one that does not, the Hermes forms (see the module's
    docstring)."""
    out: list[dict[str, Any]] = []
    history_id, history_name = served.format.history_id, served.format.history_name
    for m in messages:
        if m["role"] == "ipython" and served.format.name != "llama3":
            m = {**m, "role": "tool"}  # Llama's name for a tool's result
        calls = m.get("tool_calls")
        if native:
            if calls:
                m = {**m, "tool_calls": [_for_template(c, history_id, history_name) for c in calls]}
            if isinstance(m.get("tool_call_id"), str):
                m = {**m, "tool_call_id": history_id(m["tool_call_id"])}
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


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}


def _for_template(call: dict[str, Any], history_id, history_name) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    fn["arguments"] = _arguments(fn.get("arguments"))
    if isinstance(fn.get("name"), str):
        fn["name"] = history_name(fn["name"])
    out = {**call, "function": fn}
    if isinstance(call.get("id"), str):
        out["id"] = history_id(call["id"])
    return out


def _arguments(value: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates (transformers') read an object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
