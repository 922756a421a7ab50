"""Ollama's API beside the OpenAI one, over the same `ServingEngine`, so the official `ollama`
client and the apps that speak Ollama work unchanged.

    POST /api/chat       messages -> the model's chat template; NDJSON stream by default
    POST /api/generate   prompt (+ system) -> the chat template, or as it is with `raw`;
                         `context` (the token ids an earlier answer returned) goes in front
    GET  /api/tags       the one model served           POST /api/show   its template, details
    GET  /api/ps         the model, loaded              GET  /api/version

A streamed answer is one JSON object per line, `done: false` with each piece of text, then one
`done: true` with the reason and the counts and durations (nanoseconds); `stream: false` gives
that last object with the whole text. An error is `{"error": "..."}` (in a stream, as its last
line). The model is named `NAME` or `NAME:latest`. Options: `tandem.server.ollama_protocol`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tandem.engine.serving import Completion, PromptRejected, ServingEngine, TextDelta
from tandem.server import tools
from tandem.server.generation import generate_choices
from tandem.server.logprobs import token_entries
from tandem.server.ollama_protocol import (
    DEFAULTS,
    OllamaChatRequest,
    OllamaGenerateRequest,
    sampling_params,
)
from tandem.server.protocol import APIError
from tandem.server.structured import grammar_masks, ollama_format_spec

# The Ollama API level these routes follow (clients check /api/version against their minimum).
OLLAMA_API_VERSION = "0.12.0"
ROUTES = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version")


def add_ollama(app: FastAPI, engine: ServingEngine) -> None:
    """Registers the /api routes on `app` (its error handler answers `{"error": ...}` there)."""

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_API_VERSION}

    @app.get("/api/tags")
    async def tags():
        return {"models": [_model_entry(engine)]}

    @app.get("/api/ps")
    async def ps():
        entry = _model_entry(engine)
        entry.pop("modified_at")
        entry.update(
            expires_at="9999-12-31T23:59:59Z",  # kept loaded while the server runs
            size_vram=0,
            context_length=engine.max_seq_len,
        )
        return {"models": [entry]}

    @app.post("/api/show")
    async def show(body: dict[str, Any]):
        _check_model(engine, body.get("model") or body.get("name"))
        template = _chat_template(engine)
        params = "\n".join(f"{k:<16}{v}" for k, v in DEFAULTS.items())
        return {
            "modelfile": f"# served by tandem\nFROM {engine.model_name}\n",
            "parameters": params,
            "template": template or "",
            "details": _details(engine),
            "model_info": {"general.context_length": engine.max_seq_len},
            "capabilities": ["completion"],
            "modified_at": _timestamp(engine.started_at),
        }

    @app.post("/api/chat")
    async def chat(body: OllamaChatRequest):
        _check_model(engine, body.model)
        body.refuse_unsupported()
        if not body.messages:  # Ollama's way of loading a model
            return _loaded(engine, {"message": {"role": "assistant", "content": ""}})
        plan = tools.plan(body.tools, "auto")
        listed = plan.tools if plan is not None else None
        native = engine.template_takes_tools
        messages = tools.template_messages(
            [m.for_template(i) for i, m in enumerate(body.messages)], listed, native
        )
        prompt_ids = await _prompt_ids(
            lambda: engine.encode(engine.chat_prompt(messages, listed if native else None))
        )
        return await _answer(engine, body, prompt_ids, chat=True, parse=plan is not None)

    @app.post("/api/generate")
    async def generate(body: OllamaGenerateRequest):
        _check_model(engine, body.model)
        body.refuse_unsupported()
        if not body.prompt and not body.context:
            return _loaded(engine, {"response": ""})
        prompt_ids = await _prompt_ids(lambda: _generate_prompt(engine, body))
        return await _answer(engine, body, prompt_ids, chat=False)


async def _prompt_ids(build: Callable[[], list[int]]) -> list[int]:
    """`build()` off the event loop (a long prompt must not stall the open streams); the chat
    template's refusal, failure or limit is a 400."""
    try:
        return await asyncio.to_thread(build)
    except PromptRejected as e:
        raise APIError(400, str(e), param="messages", code=e.code) from e


async def _answer(
    engine: ServingEngine, body: Any, prompt_ids: list[int], *, chat: bool, parse: bool = False
):
    """The answer, whole or as NDJSON lines. With tools offered (`parse`) the text is held to its
    end and its `<tool_call>` blocks returned as the message's `tool_calls`."""
    params, stop = sampling_params(body, len(prompt_ids), engine.max_seq_len)
    masks = await grammar_masks(engine, ollama_format_spec(body.format), 1, "format")
    started = time.perf_counter()
    events = generate_choices(engine, prompt_ids, params, stop, 1, masks)
    logged = params.logprobs is not None
    if body.stream:
        return StreamingResponse(
            _lines(engine, events, prompt_ids, started, chat, logged, parse),
            media_type="application/x-ndjson",
        )
    first, done = None, None
    async for _, item in events:
        if isinstance(item, TextDelta):
            first = first or time.perf_counter()
        else:
            done = item
    if done is None:
        raise APIError(500, "generation ended without a result", type_="server_error")
    final = _final(engine, done, prompt_ids, started, first or started, chat)
    final["message" if chat else "response"] = _message(done.text, parse) if chat else done.text
    if logged:
        final["logprobs"] = token_entries(engine.token_bytes, done.tokens)
    return final


def _message(text: str, parse: bool) -> dict[str, Any]:
    """Ollama's assistant message: with tools offered, the calls in `text` as `tool_calls`
    (arguments as objects, as Ollama sends them)."""
    if parse:
        content, calls = tools.parse_calls(text)
        if calls:
            return {
                "role": "assistant",
                "content": content or "",
                "tool_calls": [
                    {"function": {"name": c["function"]["name"],
                                  "arguments": json.loads(c["function"]["arguments"])}}
                    for c in calls
                ],
            }  # fmt: skip
    return {"role": "assistant", "content": text}


async def _lines(
    engine, events, prompt_ids, started, chat, logged, parse=False
) -> AsyncIterator[str]:
    first = None
    try:
        async for _, item in events:
            if isinstance(item, TextDelta):
                first = first or time.perf_counter()
                if parse:
                    continue
                part = {"model": _name(engine), "created_at": _timestamp(time.time())}
                if chat:
                    part["message"] = {"role": "assistant", "content": item.text}
                else:
                    part["response"] = item.text
                if logged:
                    part["logprobs"] = token_entries(engine.token_bytes, item.tokens)
                part["done"] = False
                yield json.dumps(part) + "\n"
            else:
                if parse:
                    part = {"model": _name(engine), "created_at": _timestamp(time.time())}
                    part.update(message=_message(item.text, parse), done=False)
                    yield json.dumps(part) + "\n"
                final = _final(engine, item, prompt_ids, started, first or started, chat)
                if chat:
                    final["message"] = {"role": "assistant", "content": ""}
                else:
                    final["response"] = ""
                yield json.dumps(final) + "\n"
    except APIError as e:  # mid-stream failure: Ollama's clients read an error line
        yield json.dumps({"error": e.message}) + "\n"


def _final(engine, done: Completion, prompt_ids, started, first, chat) -> dict[str, Any]:
    now = time.perf_counter()
    out: dict[str, Any] = {
        "model": _name(engine),
        "created_at": _timestamp(time.time()),
        "done": True,
        "done_reason": done.finish_reason,
        "total_duration": _ns(now - started),
        "load_duration": 0,
        "prompt_eval_count": done.prompt_tokens - done.cached_tokens,
        "prompt_eval_duration": _ns(first - started),
        "eval_count": done.completion_tokens,
        "eval_duration": _ns(now - first),
    }
    if not chat:
        out["context"] = list(prompt_ids) + done.token_ids
    return out


def _generate_prompt(engine: ServingEngine, body: OllamaGenerateRequest) -> list[int]:
    """The ids /api/generate starts from: `context` in front, then the prompt, through the chat
    template as one user turn after the `system` one unless `raw`."""
    text = body.prompt or ""
    if not body.raw and text:
        messages = [{"role": "system", "content": body.system}] if body.system else []
        text = engine.chat_prompt([*messages, {"role": "user", "content": text}])
    elif body.raw and body.system:
        raise APIError(400, "`system` is not read with raw: true", param="system")
    if not body.context:
        return engine.encode(text)
    vocab = engine.vocab_size
    if any(not 0 <= t < vocab for t in body.context):
        raise APIError(400, f"context holds ids outside the vocabulary [0, {vocab})")
    return list(body.context) + (list(engine.tokenizer.encode(text)) if text else [])


def _loaded(engine: ServingEngine, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": _name(engine),
        "created_at": _timestamp(time.time()),
        **body,
        "done": True,
        "done_reason": "load",
    }


def _name(engine: ServingEngine) -> str:
    name = engine.model_name
    return name if ":" in name else f"{name}:latest"


def _check_model(engine: ServingEngine, model: Any) -> None:
    if model not in (engine.model_name, _name(engine)):
        raise APIError(404, f"model {model!r} not found; this server serves {_name(engine)!r}")


def _model_entry(engine: ServingEngine) -> dict[str, Any]:
    name = _name(engine)
    return {
        "name": name,
        "model": name,
        "modified_at": _timestamp(engine.started_at),
        "size": 0,  # the files' size is not known to the head (a cluster holds shards)
        "digest": hashlib.sha256(engine.model_name.encode()).hexdigest(),
        "details": _details(engine),
    }


def _details(engine: ServingEngine) -> dict[str, Any]:
    weights = None
    try:
        ranks = engine.scheduler.executor.describe().get("ranks") or []
        weights = ranks[0].get("weight_format") or ranks[0].get("dtype") if ranks else None
    except Exception:  # describe() is for the page; a head that cannot answer still lists
        weights = None
    return {
        "parent_model": "",
        "format": "gguf" if weights and weights.upper().startswith(("Q", "IQ", "MXFP")) else "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": weights or "",
    }


def _chat_template(engine: ServingEngine) -> str | None:
    config = getattr(engine.tokenizer, "config", None)
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def _timestamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
