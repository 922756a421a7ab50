"""What the HTTP server grants a connection before it has sent a request: time and bytes.

uvicorn closes a keep-alive connection that stays silent `timeout_keep_alive` seconds after a
response, but a connection that never finishes a request is never timed: a fresh one that stays
silent, or one that drips a header byte every few seconds (each byte also cancels the keep-alive
timer). `DeadlineH11Protocol` arms one deadline whenever a connection is waiting for a request (on
connect, and after each response) and closes it unless the whole request, head and body, has
arrived within `REQUEST_READ_TIMEOUT_S`; h11 bounds an unfinished head's size, and
`limit_concurrency` answers 503 past a number of connections instead of holding them all.
`HeadLimit` (ASGI middleware, around every app `tandem serve` runs) answers 431 to a finished
head over MAX_HEADER_BYTES or MAX_HEADERS (h11 parses a whole head that arrives at once whatever
its size: 64 KB and 1,000 headers passed), and `BodyLimit` (in the app) 413 to a body over
MAX_BODY_BYTES.

    uvicorn.run(app, host=host, port=port, **uvicorn_options())
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.server.protocol import APIError

REQUEST_READ_TIMEOUT_S = 10.0  # from idle to the whole request received, however it trickles
KEEP_ALIVE_S = 5.0  # a silent keep-alive connection is closed after this
MAX_HEADER_BYTES = 16 * 1024  # a request head: h11's bound while incomplete, HeadLimit's after
MAX_HEADERS = 100  # header fields in one request
MAX_CONNECTIONS = 512  # past this, new connections are answered 503


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on reading each request (see the module doc)."""

    request_read_timeout_s = REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm_read_deadline()  # the request is in: the response takes its own time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(self.request_read_timeout_s, self._read_expired)

    def _disarm_read_deadline(self) -> None:
        handle = getattr(self, "_read_deadline", None)
        if handle is not None:
            handle.cancel()
            self._read_deadline = None

    def _read_expired(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options() -> dict[str, Any]:
    """The keyword arguments `uvicorn.run` / `uvicorn.Config` take for these limits."""
    return {
        "http": DeadlineH11Protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "limit_concurrency": MAX_CONNECTIONS,
    }


def head_bytes(scope: dict) -> int:
    """The request head's size as sent, near enough: request line and header lines."""
    line = len(scope.get("method", "")) + len(scope.get("raw_path") or b"") + 12
    line += len(scope.get("query_string") or b"") + 1
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ()) + 2


class HeadLimit:
    """ASGI middleware: a request head over `max_bytes`, or with more than `max_headers` fields,
    is answered 431 in OpenAI's error shape and never reaches `app`."""

    def __init__(
        self, app: Any, max_bytes: int = MAX_HEADER_BYTES, max_headers: int = MAX_HEADERS
    ) -> None:
        self.app, self.max_bytes, self.max_headers = app, max_bytes, max_headers

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            n, size = len(scope.get("headers") or ()), head_bytes(scope)
            why = None
            if n > self.max_headers:
                why = f"{n} header fields; this server accepts at most {self.max_headers}"
            elif size > self.max_bytes:
                why = (
                    f"a request head of {size} bytes; this server accepts at most {self.max_bytes}"
                )
            if why is not None:
                await send_error(send, APIError(431, why, code="request_header_too_large"))
                return
        await self.app(scope, receive, send)


async def send_error(send: Any, err: APIError) -> None:
    """`err` as the whole response, from ASGI middleware that answers in the app's stead."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


MAX_BODY_BYTES = 2 << 20  # a request body; a prompt that fits any context tandem serves fits this


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 in OpenAI's error shape,
    at once when Content-Length says so, else as soon as the streamed body passes the limit
    (nothing past it is buffered: the app is told the client left, and what it sends is dropped)."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        seen, started, refused = 0, False, False

        async def counted_receive() -> dict:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(send, seen)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the response
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, guarded_send)

    async def _refuse(self, send: Any, size: int) -> None:
        err = APIError(
            413,
            f"the request body has at least {size} bytes; this server accepts at most "
            f"{self.max_bytes}",
            code="request_too_large",
        )
        await send_error(send, err)
