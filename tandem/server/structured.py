"""Structured output as the APIs ask for it: OpenAI's `response_format` and Ollama's `format`
read into a `GrammarSpec`, and the per-choice masks built from it (a grammar the engine refuses:
a 400 naming the field).

    {"type": "text"} / absent           -> no grammar
    {"type": "json_object"}             -> any JSON object           (Ollama: "json")
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                        -> JSON matching the schema  (Ollama: the schema itself)

`strict` changes nothing: the schema is always enforced (a schema llguidance cannot enforce in
full is refused, never loosened)."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.engine.grammar import GrammarError, GrammarSpec
from tandem.engine.logits_process import TokenMask
from tandem.engine.serving import ServingEngine
from tandem.server.protocol import APIError


def response_format_spec(value: Any) -> GrammarSpec | None:
    """OpenAI's `response_format` as a grammar (None: plain text); a 400 for a shape it is not."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refused("response_format", "must be an object with a `type`")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise _refused("response_format", "`json_schema` must be an object with a `schema`")
        return GrammarSpec("json", schema=inner.get("schema") or {})
    raise _refused("response_format", f"unknown type {kind!r} (text, json_object, json_schema)")


def ollama_format_spec(value: Any) -> GrammarSpec | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema (an object)."""
    if value in (None, ""):
        return None
    if value == "json":
        return GrammarSpec("json")
    if isinstance(value, dict):
        return GrammarSpec("json", schema=value)
    raise _refused("format", 'must be "json" or a JSON schema')


async def grammar_masks(
    engine: ServingEngine, spec: GrammarSpec | None, n: int, field: str
) -> list[TokenMask] | None:
    """One fresh mask per choice (off the event loop: the first builds the vocabulary), or None
    without a grammar; a grammar the engine refuses is a 400 naming `field`."""
    if spec is None:
        return None
    try:
        return await asyncio.to_thread(lambda: [engine.grammar_mask(spec) for _ in range(n)])
    except GrammarError as e:
        raise _refused(field, str(e)) from e


def _refused(field: str, why: str) -> APIError:
    return APIError(400, f"`{field}`: {why}", param=field, code="invalid_grammar")
