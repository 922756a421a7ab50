"""llama.cpp's native server API beside the OpenAI one, over the same `ServingEngine`, so clients
written for `llama-server` (its web UI's completion mode, editors' plugins, scripts) work unchanged.

    POST /completion (/completions)   a prompt (string or token ids) -> its continuation
    POST /tokenize                     text -> token ids (with each token's piece, if asked)
    POST /detokenize                   token ids -> text

A completion answers one JSON object: `content`, `stop: true`, `stop_type` ("eos", "word": a stop
string, its `stopping_word`; "limit": `n_predict` reached), `tokens_predicted`,
`tokens_evaluated` (prompt tokens), `tokens_cached` (of them, taken from the prefix cache),
`generation_settings`, `timings` (milliseconds, measured around the request on the head) and,
with `n_probs`, `completion_probabilities`: per token {id, token, bytes, logprob, top_logprobs:
[{id, token, bytes, logprob}]}, logprobs after penalties and before temperature (as the OpenAI
routes'). `tokens` holds the generated ids with `return_tokens`. Streamed (`stream: true`), it is
Server-Sent Events `data: {...}`, one per piece of text (`content`, `stop: false`, the piece's
`tokens` and probabilities where known), then the final object with `content: ""`; no `[DONE]`,
as llama.cpp. The fields: `tandem.server.llamacpp_protocol`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tandem.engine.grammar import GrammarSpec
from tandem.engine.serving import Completion, OutputToken, ServingEngine, TextDelta
from tandem.server.generation import drain, generate_choices
from tandem.server.llamacpp_protocol import (
    DetokenizeRequest,
    LlamaCompletionRequest,
    TokenizeRequest,
)
from tandem.server.logprobs import FLOOR, token_text
from tandem.server.protocol import APIError
from tandem.server.structured import gbnf_spec, grammar_masks

ROUTES = ("/completion", "/completions", "/tokenize", "/detokenize")


def add_llamacpp(app: FastAPI, engine: ServingEngine) -> None:
    """Registers llama.cpp's native routes on `app`."""

    async def completion(body: LlamaCompletionRequest):
        body.refuse_unsupported()
        prompt = body.prompt_text_or_ids()
        if isinstance(prompt, list):
            prompt_ids = prompt
        else:  # off the event loop, as the OpenAI routes tokenize
            prompt_ids = await asyncio.to_thread(engine.encode, prompt)
        params = body.sampling_params(len(prompt_ids), engine.max_seq_len, engine.tokenizer.encode)
        if body.stream and body.return_tokens and params.logprobs is None:
            # a piece's ids travel with its logprobs: ask for none beside the chosen token
            params = dataclasses.replace(params, logprobs=0)
        spec, field = _grammar(body)
        masks = await grammar_masks(engine, spec, 1, field)
        stop = body.stop_strings()
        t0 = time.perf_counter()
        events = generate_choices(
            engine, prompt_ids, params, stop, masks=masks, reuse_prefix=body.cache_prompt
        )
        final = _Final(engine, body, prompt_ids, stop, t0)
        if body.stream:
            return _sse(_chunks(engine, body, events, final))
        (done,) = await drain(events)
        return final.answer(done, streamed=False)

    app.post("/completion")(completion)
    app.post("/completions")(completion)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if not body.parse_special:
            raise APIError(
                400,
                "`parse_special: false` is not supported by tandem (special tokens written in "
                "the text are always matched)",
                param="parse_special",
            )
        tok = engine.tokenizer
        ids = engine.encode(body.content) if body.add_special else tok.encode(body.content)
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": _piece(engine.token_bytes(i))} for i in ids]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id(s) {bad[:5]} outside this model's vocabulary [0, {engine.vocab_size})",
                param="tokens",
            )
        return {"content": engine.tokenizer.decode(body.tokens)}


def _grammar(body: LlamaCompletionRequest) -> tuple[GrammarSpec | None, str]:
    if body.grammar is not None and body.json_schema is not None:
        raise APIError(400, "`grammar` and `json_schema`: one constraint at most", param="grammar")
    if body.grammar is not None:
        return gbnf_spec(body.grammar, "grammar"), "grammar"
    if body.json_schema is not None:
        return GrammarSpec("json", schema=body.json_schema), "json_schema"
    return None, "json_schema"


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as /tokenize shows it: its text, or its bytes where they are not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _probs(engine: ServingEngine, tokens: Sequence[OutputToken]) -> list[dict[str, Any]]:
    """`completion_probabilities`: each token's logprob and its `n_probs` most likely."""

    def entry(token: int, lp: float) -> dict[str, Any]:
        raw = engine.token_bytes(token)
        value = lp if math.isfinite(lp) else FLOOR
        return {"id": token, "token": token_text(raw), "bytes": list(raw), "logprob": value}

    out = []
    for t in tokens:
        lp = t.logprobs
        item = entry(lp.token, lp.logprob)
        item["top_logprobs"] = [entry(i, v) for i, v in lp.top]
        out.append(item)
    return out


class _Final:
    """The last object of a completion, streamed or not."""

    def __init__(
        self,
        engine: ServingEngine,
        body: LlamaCompletionRequest,
        prompt_ids: list[int],
        stop: tuple[str, ...],
        t0: float,
    ) -> None:
        self.engine = engine
        self.body = body
        self.prompt_ids = prompt_ids
        self.stop = stop
        self.t0 = t0  # when the request was submitted
        self.first: float | None = None  # when the first piece of text came

    def answer(self, c: Completion, streamed: bool) -> dict[str, Any]:
        end = time.perf_counter()
        first = self.first or end
        stop_type, word = self._why(c)
        prompt_ms = (first - self.t0) * 1e3
        predicted_ms = (end - first) * 1e3
        out: dict[str, Any] = {
            "index": 0,
            "content": "" if streamed else c.text,
            "tokens": list(c.token_ids) if self.body.return_tokens and not streamed else [],
            "id_slot": -1,
            "stop": True,
            "model": self.engine.model_name,
            "tokens_predicted": c.completion_tokens,
            "tokens_evaluated": c.prompt_tokens,
            "generation_settings": {
                **self.body.settings(),
                "n_ctx": self.engine.max_seq_len,
                "model": self.engine.model_name,
            },
            "prompt": self.engine.tokenizer.decode(self.prompt_ids),
            "has_new_line": "\n" in c.text,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": c.cached_tokens,
            "timings": {
                "cache_n": c.cached_tokens,
                "prompt_n": c.prompt_tokens - c.cached_tokens,
                "prompt_ms": prompt_ms,
                "predicted_n": c.completion_tokens,
                "predicted_ms": predicted_ms,
                "predicted_per_second": c.completion_tokens / predicted_ms * 1e3
                if predicted_ms > 0
                else 0.0,
            },
        }
        if not streamed and self.body.n_probs:
            out["completion_probabilities"] = _probs(self.engine, c.tokens)
        return out

    def _why(self, c: Completion) -> tuple[str, str]:
        """(stop_type, stopping_word): a stop string cut the text where the whole decoded output
        goes on with it; else a "stop" was the EOS."""
        if c.finish_reason == "length":
            return "limit", ""
        whole = self.engine.tokenizer.decode(c.token_ids)
        for s in self.stop:
            if s and whole.startswith(s, len(c.text)):
                return "word", s
        return "eos", ""


async def _chunks(
    engine: ServingEngine, body: LlamaCompletionRequest, events, final: _Final
) -> AsyncIterator[dict[str, Any]]:
    async for _, item in events:
        if isinstance(item, TextDelta):
            final.first = final.first or time.perf_counter()
            chunk: dict[str, Any] = {
                "index": 0,
                "content": item.text,
                "tokens": [t.logprobs.token for t in item.tokens],
                "stop": False,
                "id_slot": -1,
                "tokens_evaluated": len(final.prompt_ids),
            }
            if body.n_probs:
                chunk["completion_probabilities"] = _probs(engine, item.tokens)
            yield chunk
        else:
            yield final.answer(item, streamed=True)


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except APIError as e:  # mid-stream failure: reported in-band
            yield f"data: {json.dumps(e.body())}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
