"""Mistral tool calls after the `[TOOL_CALLS]` token: a JSON array of call objects (Mistral 7B
v0.3, Nemo, Small up to 3.1),

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, in the newer tokenizers (Mistral Small 3.2, Ministral 3, Devstral), each call as
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`. Mistral's templates refuse a call id that is
not 9 letters and digits, so tandem's ids for this format are such, and ids of other shapes in
a conversation's history are mapped to such (the same id always to the same one)."""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from typing import Any

from tandem.server.call_stream import CallSyntax
from tandem.server.tool_formats import Literal, ToolFormat, call_schema

TOOL_CALLS = "[TOOL_CALLS]"
ALPHABET = string.ascii_letters + string.digits


def grammar(tools: list[dict[str, Any]], literal: Literal) -> str:
    """The marker, then an array of one call object."""
    schema = json.dumps(call_schema(tools, "arguments"))
    return f'start: {literal(TOOL_CALLS)} "[" call "]"\ncall: %json {schema}'


def writes(template: str) -> bool:
    return TOOL_CALLS in template


def new_id() -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(9))


def history_id(call_id: str) -> str:
    """A 9-character id for `call_id` (itself when it already is one)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(ALPHABET[b % len(ALPHABET)] for b in digest[:9])


SYNTAX = CallSyntax(openers=(TOOL_CALLS,), array=True, seps=",", named=True)
FORMAT = ToolFormat("mistral", SYNTAX, grammar, (TOOL_CALLS,), new_id, history_id)
