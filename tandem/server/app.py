"""The OpenAI-compatible HTTP API over a `ServingEngine`: chat and text completions (SSE or not),
models, health and Prometheus metrics, and Ollama's API beside it (`tandem.server.ollama`), and
llama.cpp's native `/completion`, `/tokenize` and `/detokenize` (`tandem.server.llamacpp`).
Errors use OpenAI's `{"error": {...}}` body (Ollama's `{"error": "..."}` under /api/)."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.engine.serving import (
    Completion,
    PromptRejected,
    ServingEngine,
    TextDelta,
)
from tandem.server import reasoning_format, tool_formats, tools
from tandem.server.answers import ChoiceAnswer, Part
from tandem.server.cluster_view import render_cluster_metrics
from tandem.server.generation import drain, generate_choices
from tandem.server.http_limits import MAX_BODY_BYTES, BodyLimit
from tandem.server.llamacpp import ROUTES as LLAMACPP_ROUTES
from tandem.server.llamacpp import add_llamacpp
from tandem.server.logprobs import chat_logprobs, completion_logprobs
from tandem.server.metrics import render_metrics
from tandem.server.ollama import ROUTES as OLLAMA_ROUTES
from tandem.server.ollama import add_ollama
from tandem.server.page import add_page
from tandem.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    error_response,
    keyed,
)
from tandem.server.reasoning_grammar import chat_grammar
from tandem.server.structured import grammar_masks, request_grammar

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(
    engine: ServingEngine,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    reasoning: str = "auto",
    tool_parser: str = "auto",
) -> FastAPI:
    """The API over `engine`; with `api_key`, /v1 and /api need `Authorization: Bearer <key>` (and only
    such a caller sees /health's full detail). Bodies over `max_body_bytes` are answered 413.
    `reasoning`: how chat answers are read for reasoning (`reasoning_format.choose`);
    `tool_parser`: the tool-call format (`tool_formats.choose`)."""
    fmt = reasoning_format.choose(engine.tokenizer, reasoning)
    served = tool_formats.serve(
        tool_formats.choose(engine.template_source, fmt.kind, tool_parser), engine.tokenizer
    )
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None)
    http_counts: dict[tuple[str, int], int] = {}

    def authenticated(request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return bool(api_key) and hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        path = request.url.path
        if api_key and keyed(path) and not authenticated(request):
            err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
            _count(http_counts, path, 401)
            return error_response(path, err)
        response = await call_next(request)
        _count(http_counts, path, response.status_code)
        return response

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before anything reads

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        param = loc[0] if loc else None  # the request field at fault, as OpenAI names it
        return error_response(request.url.path, APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return error_response(request.url.path, err)

    @app.get("/health")
    async def health(request: Request):
        ok, detail = engine.health()
        if not authenticated(request):  # no log tails, paths or peers for strangers
            detail = public_detail(detail)
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "detail": detail}, 200 if ok else 503
        )

    cluster = add_page(app, engine)  # GET /, /static/*, /v1/cluster
    add_ollama(app, engine, fmt, served)  # /api/*
    add_llamacpp(app, engine)  # /completion, /tokenize, /detokenize

    @app.get("/metrics")
    async def metrics():
        ok, _ = engine.health()
        text = render_metrics(engine.metrics(), ok, dict(http_counts))
        text += render_cluster_metrics(cluster.view())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(engine)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        _check_model(engine, model_id)
        return _model_card(engine)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        _check_model(engine, body.model)
        body.refuse_unsupported()
        tool_plan = tools.plan(body.tools, body.tool_choice, served)
        grammar, field = request_grammar(body)
        if tool_plan is not None and tool_plan.grammar is not None:
            if grammar is not None:
                raise APIError(
                    400,
                    f"a forced tool call and a `{field}` cannot both hold",
                    param="tool_choice",
                )
            field = "tool_choice"
        variables = body.template_variables(engine.template_reads)
        native = engine.template_takes_tools
        listed = tool_plan.tools if tool_plan is not None else None
        bound = tools.for_request(served, listed, variables, engine.template_reads)
        messages = tools.template_messages(
            [m.for_template(i) for i, m in enumerate(body.messages)], listed, native, bound
        )

        def prompt() -> tuple[list[int], list]:
            text = engine.chat_prompt(messages, listed if native else None, variables)
            ids = engine.encode(text)
            return ids, fmt.prompt_tail(ids, engine.tokenizer.decode)

        # off the event loop: a long prompt must not stall every open stream while it tokenizes
        try:
            prompt_ids, tail = await asyncio.to_thread(prompt)
        except PromptRejected as e:  # the template's refusal, failure or limit: named
            raise APIError(400, str(e), param="messages", code=e.code) from e
        params = _params(engine, body, prompt_ids, default_max=None)
        grammar = chat_grammar(fmt, grammar, tool_plan, tail)
        masks = await grammar_masks(engine, grammar, body.n, field)
        parse = tool_plan is not None and tool_plan.parse
        kept = served.ids if parse else {}  # the format's marker tokens, read as their text
        answers = [ChoiceAnswer(fmt.reader(tail, kept), parse, bound) for _ in range(body.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        markers = fmt.marker_ids | frozenset(kept)
        events = generate_choices(
            engine, prompt_ids, params, body.stop_strings(), body.n, masks, markers
        )
        shown = fmt.kind != "none"  # reasoning_content is a field of this server's answers
        if body.stream:
            return _sse(_chat_chunks(engine, events, rid, created, body, answers, shown))
        done = await drain(events, body.n)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": engine.model_name,
            "choices": [
                {
                    "index": i,
                    **_chat_message(c, answers[i], shown),
                    "logprobs": None
                    if params.logprobs is None
                    else chat_logprobs(engine.token_bytes, c.tokens),
                }
                for i, c in enumerate(done)
            ],
            "usage": _usage(done),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        _check_model(engine, body.model)
        body.refuse_unsupported()
        prompt = body.prompt_text_or_ids()
        if isinstance(prompt, list):
            prompt_ids = prompt
        else:
            prompt_ids = await asyncio.to_thread(engine.encode, prompt)
        params = _params(engine, body, prompt_ids, default_max=DEFAULT_COMPLETION_MAX_TOKENS)
        spec, field = request_grammar(body)
        masks = await grammar_masks(engine, spec, body.n, field)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        events = generate_choices(engine, prompt_ids, params, body.stop_strings(), body.n, masks)
        if body.stream:
            return _sse(_text_chunks(engine, events, rid, created, body))
        done = await drain(events, body.n)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": engine.model_name,
            "choices": [
                {
                    "index": i,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None
                    if params.logprobs is None
                    else completion_logprobs(engine.token_bytes, c.tokens),
                }
                for i, c in enumerate(done)
            ],
            "usage": _usage(done),
        }

    return app


ROUTES = (
    "/",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/cluster",
    "/health",
    "/metrics",
    *OLLAMA_ROUTES,
    *LLAMACPP_ROUTES,
)


PUBLIC_DETAIL_CHARS = 200


def route_label(path: str) -> str:
    """The /metrics label of a request path: one of the served routes, else "other" (so
    strangers' made-up paths cannot grow the label set)."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/") and path.count("/") == 3:
        return "/v1/models/{model_id}"
    if path.startswith("/static/") and path.count("/") == 2:
        return "/static/{name}"
    return "other"


def public_detail(detail: str) -> str:
    """What /health tells an unauthenticated caller: the first line of the reason, shortened."""
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    return first if len(first) <= PUBLIC_DETAIL_CHARS else first[: PUBLIC_DETAIL_CHARS - 3] + "..."


def _count(counts: dict[tuple[str, int], int], path: str, status: int) -> None:
    key = (route_label(path), status)
    counts[key] = counts.get(key, 0) + 1


def _model_card(engine: ServingEngine) -> dict[str, Any]:
    return {
        "id": engine.model_name,
        "object": "model",
        "created": int(engine.started_at),
        "owned_by": "tandem",
        "max_model_len": engine.max_seq_len,
    }


def _check_model(engine: ServingEngine, model: str) -> None:
    if model != engine.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{engine.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _params(
    engine: ServingEngine, body: _Sampling, prompt_ids: list[int], default_max: int | None
) -> SamplingParams:
    if len(prompt_ids) >= engine.max_seq_len:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.max_seq_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens. Shorten the prompt.",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_max or engine.max_seq_len - len(prompt_ids)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    bias = body.bias_pairs()
    vocab = engine.vocab_size
    outside = [t for t, _ in bias if t >= vocab]
    if outside:
        raise APIError(
            400,
            f"logit_bias names token id(s) {outside[:5]} outside this model's vocabulary "
            f"[0, {vocab})",
            param="logit_bias",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),  # -1: off
            min_p=body.min_p or 0.0,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=bias,
            logprobs=body.logprobs_wanted(),
        )
    except SamplingParamsError as e:
        raise APIError(400, str(e)) from e


def _usage(done: list[Completion]) -> dict[str, Any]:
    """OpenAI's usage object, one per request whatever `n`: the prompt once, every choice's
    tokens. `cached_tokens`: the prompt positions no choice of the request prefilled. Choice i
    prefills positions [cached_i, P) (the rest it took from the prefix cache or copied from a
    sibling that prefilled them), so the request prefilled their union [min_i cached_i, P) and
    reused the first min_i cached_i from earlier requests."""
    prompt = done[0].prompt_tokens
    completion = sum(c.completion_tokens for c in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": min(c.cached_tokens for c in done)},
    }


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except APIError as e:  # mid-stream failure: report it in-band, as OpenAI does
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _chat_message(c: Completion, answer: ChoiceAnswer, shown: bool) -> dict[str, Any]:
    """A choice's `message` and `finish_reason`: its reasoning as `reasoning_content` (where the
    model has a reasoning format), its content, and its calls as `tool_calls` (finish_reason
    "tool_calls")."""
    part = answer.whole(c)
    message: dict[str, Any] = {"role": "assistant", "content": part.content}
    if shown:
        message["reasoning_content"] = part.reasoning or None
    if part.calls:
        message.update(content=part.content or None, tool_calls=part.calls)
    return {"message": message, "finish_reason": answer.finish_reason(c)}


async def _chat_chunks(
    engine, events, rid, created, body, answers: list[ChoiceAnswer], shown: bool
) -> AsyncIterator[dict[str, Any]]:
    """The chat's SSE chunks: reasoning as `delta.reasoning_content`, content as
    `delta.content` and calls as `delta.tool_calls` (index, id, type and name first, then the
    arguments in pieces) as they are read (`answers.ChoiceAnswer`)."""
    logged = body.logprobs_wanted() is not None
    done: dict[int, Completion] = {}

    def chunk(i: int, delta: dict, finish: str | None = None, lps: Any = None) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": engine.model_name,
            "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": lps}],
        }

    def delta(i: int, part: Part) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if part.reasoning:
            out["reasoning_content"] = part.reasoning
        if part.content:
            out["content"] = part.content
        if part.deltas:
            out["tool_calls"] = part.deltas
        return out

    for i in range(body.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, item in events:
        if isinstance(item, TextDelta):
            lps = chat_logprobs(engine.token_bytes, item.tokens) if logged else None
            out = delta(i, answers[i].read(item))
            if out or lps:
                yield chunk(i, out if out or shown else {"content": ""}, lps=lps)
        else:
            done[i] = item
            out = delta(i, answers[i].finish())
            if out:
                yield chunk(i, out)
            yield chunk(i, {}, answers[i].finish_reason(item))
    if body.stream_options and body.stream_options.include_usage:
        yield {**chunk(0, {}), "choices": [], "usage": _usage([done[i] for i in sorted(done)])}


async def _text_chunks(engine, events, rid, created, body) -> AsyncIterator[dict[str, Any]]:
    logged = body.logprobs_wanted() is not None
    done: dict[int, Completion] = {}

    def chunk(i: int, text: str, finish: str | None = None, lps: Any = None) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": engine.model_name,
            "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": lps}],
        }

    async for i, item in events:
        if isinstance(item, TextDelta):
            lps = completion_logprobs(engine.token_bytes, item.tokens) if logged else None
            yield chunk(i, item.text, lps=lps)
        else:
            done[i] = item
            yield chunk(i, "", item.finish_reason)
    if body.stream_options and body.stream_options.include_usage:
        yield {**chunk(0, ""), "choices": [], "usage": _usage([done[i] for i in sorted(done)])}
