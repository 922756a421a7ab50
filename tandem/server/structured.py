"""Structured output as the APIs ask for it: OpenAI's `response_format` and Ollama's `format`
read into a `GrammarSpec`, and the per-choice masks built from it (a grammar the engine refuses:
a 400 naming the field).

    {"type": "text"} / absent           -> no grammar
    {"type": "json_object"}             -> any JSON object           (Ollama: "json")
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                        -> JSON matching the schema  (Ollama: the schema itself)

`strict` changes nothing: the schema is always enforced (a schema llguidance cannot enforce in
full is refused, never loosened).

A GBNF grammar (llama.cpp's `grammar`; vLLM's `guided_grammar` and `structured_outputs.grammar`)
is read by `tandem.engine.gbnf` into a Lark grammar; one that does not parse or can match nothing
is a 400 naming the field and the line and column. A request names one constraint at most."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.engine import gbnf
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


def request_grammar(body: Any) -> tuple[GrammarSpec | None, str]:
    """The constraint an OpenAI request names and the field naming it: `response_format`, or a
    GBNF grammar under `grammar`, `guided_grammar` or `structured_outputs.grammar`; a 400 for two
    at once, or for a `structured_outputs` key other than `grammar`."""
    named: list[tuple[str, Any]] = []
    if body.response_format is not None and body.response_format.get("type") != "text":
        named.append(("response_format", body.response_format))
    for field in ("grammar", "guided_grammar"):
        if getattr(body, field) is not None:
            named.append((field, getattr(body, field)))
    outputs = body.structured_outputs or {}
    if not isinstance(outputs, dict):
        raise _refused("structured_outputs", 'must be an object such as {"grammar": GBNF}')
    for key, value in outputs.items():
        if key != "grammar":
            raise _refused(f"structured_outputs.{key}", "not supported by tandem (only `grammar`)")
        named.append(("structured_outputs.grammar", value))
    if len(named) > 1:
        fields = ", ".join(f"`{f}`" for f, _ in named)
        raise APIError(400, f"{fields}: a request names one constraint at most", param=named[1][0])
    if not named:
        return response_format_spec(body.response_format), "response_format"
    field, value = named[0]
    if field == "response_format":
        return response_format_spec(value), field
    return gbnf_spec(value, field), field


def gbnf_spec(text: Any, field: str) -> GrammarSpec:
    """A GBNF grammar as the Lark grammar it reads into; a 400 naming `field` and the place."""
    if not isinstance(text, str):
        raise _refused(field, "must be a GBNF grammar (a string)")
    try:
        return GrammarSpec("lark", text=gbnf.to_lark(text))
    except gbnf.GbnfError as e:
        raise _refused(field, str(e)) from e


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
