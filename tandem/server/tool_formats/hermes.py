"""Qwen / Hermes tool calls: each call a `<tool_call>` block of one JSON object,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format of Qwen2.5 / Qwen3's templates and of the Hermes system prompt tandem writes for a
template that does not take tools itself (`tools.template_messages`)."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.call_stream import CallSyntax
from tandem.server.tool_formats import Literal, ToolFormat, call_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def grammar(tools: list[dict[str, Any]], literal: Literal) -> str:
    """One block: the call's JSON between the tags, on its own line."""
    schema = json.dumps(call_schema(tools, "arguments"))
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {schema}'


def writes(template: str) -> bool:
    return OPEN in template


FORMAT = ToolFormat("hermes", CallSyntax(openers=(OPEN,), close=CLOSE), grammar)
