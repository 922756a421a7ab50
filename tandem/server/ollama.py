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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tandem.engine.serving import Completion, PromptRejected, ServingEngine, TextDelta
from tandem.server import tools
from tandem.server.answers import ChoiceAnswer, Part
from tandem.server.generation import generate_choices
from tandem.server.logprobs import token_entries
from tandem.server.ollama_protocol import (
    DEFAULTS,
    OllamaChatRequest,
    OllamaGenerateRequest,
    sampling_params,
)
from tandem.server.protocol import APIError
from tandem.server.reasoning_format import ReasoningFormat
from tandem.server.reasoning_grammar import hold_answer
from tandem.server.structured import grammar_masks, ollama_format_spec
from tandem.server.tool_formats import ServedFormat
from tandem.server.tools import HERMES

PLAIN = ReasoningFormat("none", {})  # no reasoning format: the output is the content

# The Ollama API level these routes follow (clients check /api/version against their minimum).
OLLAMA_API_VERSION = "0.12.0"
ROUTES = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version")


def add_ollama(
    app: FastAPI, engine: ServingEngine, fmt: ReasoningFormat = PLAIN, served: ServedFormat = HERMES
) -> None:
    """Registers the /api routes on `app` (its error handler answers `{"error": ...}` there);
    answers are read for reasoning by `fmt`, for tool calls in the `served` format."""

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
            "capabilities": ["completion", *(["thinking"] if fmt.kind != "none" else [])],
            "modified_at": _timestamp(engine.started_at),
        }

    @app.post("/api/chat")
    async def chat(body: OllamaChatRequest):
        _check_model(engine, body.model)
        body.refuse_unsupported()
        if not body.messages:  # Ollama's way of loading a model
            return _loaded(engine, {"message": {"role": "assistant", "content": ""}})
        variables = _think_variables(engine, fmt, body.think)
        plan = tools.plan(body.tools, "auto", served)
        listed = plan.tools if plan is not None else None
        native = engine.template_takes_tools
        bound = tools.for_request(served, listed, variables, engine.template_reads)
        messages = tools.template_messages(
            [m.for_template(i) for i, m in enumerate(body.messages)], listed, native, bound
        )
        prompt_ids, tail = await _prompt_ids(
            fmt,
            engine,
            lambda: engine.encode(
                engine.chat_prompt(messages, listed if native else None, variables)
            ),
        )
        reading = _Reading(fmt, tail, plan is not None, body.think is not False, bound)
        return await _answer(engine, body, prompt_ids, reading, chat=True)

    @app.post("/api/generate")
    async def generate(body: OllamaGenerateRequest):
        _check_model(engine, body.model)
        body.refuse_unsupported()
        if not body.prompt and not body.context:
            return _loaded(engine, {"response": ""})
        if body.raw and body.think:
            raise APIError(400, "`think` is not read with raw: true", param="think")
        read = PLAIN if body.raw else fmt  # raw: the text as the model writes it
        variables = _think_variables(engine, read, body.think)
        prompt_ids, tail = await _prompt_ids(
            read, engine, lambda: _generate_prompt(engine, body, variables)
        )
        reading = _Reading(read, tail, False, body.think is not False, served)
        return await _answer(engine, body, prompt_ids, reading, chat=False)


@dataclass(frozen=True)
class _Reading:
    """How a request's output is read: its reasoning format and the prompt's tail it continues,
    whether tool calls are parsed, whether the reasoning is returned (`think` not false)."""

    fmt: ReasoningFormat
    tail: list
    parse: bool
    thinking: bool
    served: ServedFormat


def _think_variables(engine: ServingEngine, fmt: ReasoningFormat, think: Any) -> dict[str, Any]:
    """Ollama's `think` as the chat template's variables: `enable_thinking` (Qwen3's), and a
    level as `reasoning_effort` (gpt-oss's), where the template reads them; thinking asked of a
    model without a reasoning format is a 400, as Ollama answers it."""
    if think is None:
        return {}
    if think is not False and fmt.kind == "none":
        raise APIError(400, f"{_name(engine)!r} does not support thinking", param="think")
    out: dict[str, Any] = {}
    if engine.template_reads("enable_thinking"):
        out["enable_thinking"] = think is not False
    if isinstance(think, str) and engine.template_reads("reasoning_effort"):
        out["reasoning_effort"] = think
    return out


async def _prompt_ids(
    fmt: ReasoningFormat, engine: ServingEngine, ids: Callable[[], list[int]]
) -> tuple[list[int], list]:
    """The prompt's `ids()` and the tail of it the output continues (`prompt_tail`), built off
    the event loop (a long prompt must not stall the open streams); the chat template's
    refusal, failure or limit is a 400."""

    def build() -> tuple[list[int], list]:
        prompt = ids()
        return prompt, fmt.prompt_tail(prompt, engine.tokenizer.decode)

    try:
        return await asyncio.to_thread(build)
    except PromptRejected as e:
        raise APIError(400, str(e), param="messages", code=e.code) from e


async def _answer(
    engine: ServingEngine, body: Any, prompt_ids: list[int], reading: _Reading, *, chat: bool
):
    """The answer, whole or as NDJSON lines: reasoning as `thinking` (unless `think` is false),
    the content, and with tools offered the calls as the message's `tool_calls` (the content
    then held to its end)."""
    params, stop = sampling_params(body, len(prompt_ids), engine.max_seq_len)
    spec = ollama_format_spec(body.format)
    if spec is not None:
        spec = hold_answer(reading.fmt, spec, reading.tail)
    masks = await grammar_masks(engine, spec, 1, "format")
    started = time.perf_counter()
    kept = reading.served.ids if reading.parse else {}  # the call format's marker tokens
    markers = reading.fmt.marker_ids | frozenset(kept)
    events = generate_choices(engine, prompt_ids, params, stop, 1, masks, markers)
    answer = ChoiceAnswer(reading.fmt.reader(reading.tail, kept), reading.parse, reading.served)
    logged = params.logprobs is not None
    if body.stream:
        return StreamingResponse(
            _lines(engine, events, prompt_ids, started, chat, logged, answer, reading.thinking),
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
    final.update(_said(answer.whole(done), chat, reading.thinking))
    if logged:
        final["logprobs"] = token_entries(engine.token_bytes, done.tokens)
    return final


def _said(part: Part, chat: bool, thinking: bool) -> dict[str, Any]:
    """A stretch of the answer as Ollama's fields: chat's `message` (content, `thinking`,
    `tool_calls` with arguments as objects, as Ollama sends them), or generate's `response` and
    `thinking`."""
    think = {"thinking": part.reasoning} if thinking and part.reasoning else {}
    if not chat:
        return {"response": part.content, **think}
    message: dict[str, Any] = {"role": "assistant", "content": part.content, **think}
    if part.calls:
        message["tool_calls"] = [
            {"function": {"name": c["function"]["name"],
                          "arguments": _object(c["function"]["arguments"])}}
            for c in part.calls
        ]  # fmt: skip
    return {"message": message}


def _object(arguments: str) -> Any:
    """A call's arguments as Ollama sends them, an object (as written where they are not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


async def _lines(
    engine, events, prompt_ids, started, chat, logged, answer: ChoiceAnswer, thinking: bool
) -> AsyncIterator[str]:
    first = None

    def line(part: Part, lps: Any = None) -> str:
        out = {"model": _name(engine), "created_at": _timestamp(time.time())}
        out.update(_said(part, chat, thinking))
        if lps is not None:
            out["logprobs"] = lps
        return json.dumps({**out, "done": False}) + "\n"

    try:
        async for _, item in events:
            if isinstance(item, TextDelta):
                first = first or time.perf_counter()
                part = answer.read(item)
                lps = token_entries(engine.token_bytes, item.tokens) if logged else None
                if part.content or part.calls or (thinking and part.reasoning) or lps:
                    yield line(part, lps)
            else:
                part = answer.finish()
                if part.content or part.calls or (thinking and part.reasoning):
                    yield line(part)
                final = _final(engine, item, prompt_ids, started, first or started, chat)
                final.update(_said(Part(), chat, False))
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


def _generate_prompt(
    engine: ServingEngine, body: OllamaGenerateRequest, variables: dict[str, Any]
) -> list[int]:
    """The ids /api/generate starts from: `context` in front, then the prompt, through the chat
    template (with its `variables`) as one user turn after the `system` one unless `raw`."""
    text = body.prompt or ""
    if not body.raw and text:
        messages = [{"role": "system", "content": body.system}] if body.system else []
        text = engine.chat_prompt([*messages, {"role": "user", "content": text}], None, variables)
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
