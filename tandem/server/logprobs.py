"""Generated tokens' logprobs (`OutputToken`s) in the shapes the APIs answer with.

    chat (OpenAI)         {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
                          bytes}]}], "refusal": null}
    completions (OpenAI)  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
                          "text_offset"}; each top_logprobs map also holds the chosen token, as
                          OpenAI's ("up to logprobs + 1 elements")
    Ollama                [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]

A token's text is its bytes (`ServingEngine.token_bytes`) as UTF-8, or, for a token that holds
part of a character, OpenAI's `bytes:\\xNN...` form; `bytes` always has the exact bytes. A logprob
of -inf (a token a mask ruled out) is reported as -9999.0, as OpenAI and vLLM do: JSON has no
infinity. Completions' `text_offset` counts characters of the completion's own text (no echo).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from tandem.engine.serving import OutputToken

FLOOR = -9999.0

TokenBytes = Callable[[int], bytes]


def token_text(raw: bytes) -> str:
    """A token's text: its bytes as UTF-8, or `bytes:\\xe2\\x80` for bytes that are not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


def _entry(token_bytes: TokenBytes, token: int, lp: float) -> dict[str, Any]:
    raw = token_bytes(token)
    return {"token": token_text(raw), "logprob": _finite(lp), "bytes": list(raw)}


def token_entries(token_bytes: TokenBytes, tokens: Sequence[OutputToken]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` items (and Ollama's `logprobs`)."""
    out = []
    for t in tokens:
        lp = t.logprobs
        item = _entry(token_bytes, lp.token, lp.logprob)
        item["top_logprobs"] = [_entry(token_bytes, i, v) for i, v in lp.top]
        out.append(item)
    return out


def chat_logprobs(token_bytes: TokenBytes, tokens: Sequence[OutputToken]) -> dict[str, Any]:
    return {"content": token_entries(token_bytes, tokens), "refusal": None}


def completion_logprobs(token_bytes: TokenBytes, tokens: Sequence[OutputToken]) -> dict[str, Any]:
    texts, values, tops, offsets = [], [], [], []
    for t in tokens:
        lp = t.logprobs
        texts.append(token_text(token_bytes(lp.token)))
        values.append(_finite(lp.logprob))
        top = {token_text(token_bytes(i)): _finite(v) for i, v in lp.top}
        top.setdefault(texts[-1], values[-1])
        tops.append(top)
        offsets.append(t.offset)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
