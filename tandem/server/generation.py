"""The bridge from the scheduler's thread to a route's coroutine: `generate_choices` submits the
n choices of one request and yields their deltas and ends, tagged with the choice's index, as
the scheduler produces them; `drain` waits for all of them. The OpenAI and Ollama routes share it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.engine.logits_process import TokenMask
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import RequestFailed
from tandem.engine.serving import (
    Completion,
    EngineUnavailable,
    RequestRejected,
    ServingEngine,
    TextDelta,
)
from tandem.server.protocol import APIError

Event = tuple[int, TextDelta | Completion]  # (choice index, a delta or the choice's end)


def generate_choices(
    engine: ServingEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    stop: tuple[str, ...],
    n: int = 1,
    masks: list[TokenMask] | None = None,
    markers: frozenset[int] = frozenset(),
    reuse_prefix: bool = True,
) -> AsyncIterator[Event]:
    """Submits `n` choices now (so admission errors become 4xx/5xx before any response starts),
    choice i drawing from its own stream of the seed (`SamplingParams.choice`), and returns the
    stream of their deltas and ends, each tagged with its choice's index. Each choice is its own
    sequence (with the prefix cache, the first prefills the prompt and the others copy it). `masks`: choice i's `TokenMask`
    (structured output), one per choice; `markers`: the reasoning format's marker tokens, kept out
    of the text and reported as `Mark`s; `reuse_prefix`: False prefills the whole prompt even
    where the prefix cache holds its head."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_delta(i: int) -> Callable[[TextDelta], None]:
        return lambda d: loop.call_soon_threadsafe(queue.put_nowait, (i, d))

    def on_done(i: int) -> Callable[[Completion | None, BaseException | None], None]:
        return lambda c, e: loop.call_soon_threadsafe(queue.put_nowait, (i, (c, e)))

    handles: list[Any] = []
    try:
        for i in range(n):
            p = params if i == 0 else dataclasses.replace(params, choice=i)
            mask = masks[i] if masks is not None else None
            handles.append(
                engine.generate(
                    prompt_ids, p, stop, on_delta(i), on_done(i), mask, markers, reuse_prefix
                )
            )
    except (RequestRejected, EngineUnavailable) as e:
        for h in handles:
            h.cancel()
        if isinstance(e, RequestRejected):
            raise APIError(400, str(e)) from e
        raise APIError(503, str(e), type_="server_error", code="engine_unavailable") from e
    return _events(queue, handles)


async def _events(queue: asyncio.Queue, handles: list[Any]) -> AsyncIterator[Event]:
    """Cancels the generations when the consumer goes away (a client that disconnects
    mid-stream) or one of them fails."""
    try:
        left = len(handles)
        while left:
            i, item = await queue.get()
            if isinstance(item, TextDelta):
                yield i, item
                continue
            completion, error = item
            if isinstance(error, RequestFailed):  # this request alone; the engine serves on
                raise APIError(500, str(error), type_="server_error", code="request_failed")
            if error is not None:
                raise APIError(503, str(error), type_="server_error", code="engine_unavailable")
            left -= 1
            yield i, completion
    finally:
        for h in handles:
            h.cancel()


async def drain(events: AsyncIterator[Event], n: int = 1) -> list[Completion]:
    """Every choice's Completion, in choice order."""
    done: dict[int, Completion] = {}
    async for i, item in events:
        if isinstance(item, Completion):
            done[i] = item
    if len(done) != n:
        raise APIError(500, "generation ended without a result", type_="server_error")
    return [done[i] for i in range(n)]
