"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer is the call, a bare JSON object

    {"name": "get_weather", "parameters": {"city": "Paris"}}

as Meta's templates write past calls and ask for new ones (`<|python_tag|>` may lead, as for the
built-in tools; calls after the first follow a `;`). Tool results go back as the `ipython` role
(the template maps `role: tool` to it)."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.call_stream import CallSyntax
from tandem.server.tool_formats import Literal, ToolFormat, call_schema

PYTHON_TAG = "<|python_tag|>"


def grammar(tools: list[dict[str, Any]], literal: Literal) -> str:
    """The answer is one call object, `parameters` holding the arguments."""
    return f"start: %json {json.dumps(call_schema(tools, 'parameters'))}"


def writes(template: str) -> bool:
    return PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template)


SYNTAX = CallSyntax(openers=(PYTHON_TAG,), at_start=True, seps=";")
FORMAT = ToolFormat("llama3", SYNTAX, grammar, markers=(PYTHON_TAG,))
