"""The HTTP server closes connections that never finish a request (silent, or dripping a header
byte at a time) and idle keep-alive connections, while other clients are served at once. A real
uvicorn server on loopback and raw sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
from fastapi import FastAPI
from http_server_support import running_server
from raw_http import status_line

from tandem.server.http_limits import MAX_HEADER_BYTES, DeadlineH11Protocol, HeadLimit


class _Quick(DeadlineH11Protocol):
    request_read_timeout_s = 1.5


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def _closed_after(s: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes `s` (reading and discarding what it sends)."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    while s.recv(4096):
        pass
    return time.monotonic() - t0


def test_a_silent_connection_and_a_dripped_header_are_closed_at_the_read_deadline() -> None:
    with running_server(_app(), http=_Quick) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        drip = socket.create_connection(("127.0.0.1", port))
        dripped = threading.Event()

        def trickle() -> None:
            try:
                for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                    drip.sendall(bytes([b]))
                    time.sleep(0.2)
            except OSError:
                dripped.set()

        threading.Thread(target=trickle, daemon=True).start()
        t0 = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        assert time.monotonic() - t0 < 1.0  # served while the others hang on
        assert _closed_after(silent, 5) < 3.0
        assert _closed_after(drip, 5) < 3.0
        assert dripped.wait(3)  # the dripper's next byte fails: the server hung up on it
        silent.close()
        drip.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout() -> None:
    with running_server(_app(), http=_Quick, timeout_keep_alive=1) as port:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(3)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        assert _closed_after(s, 5) < 2.5
        s.close()


def test_a_header_over_16_kb_is_refused() -> None:
    with running_server(_app()) as port:
        s = socket.create_connection(("127.0.0.1", port))
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 * 1024))
        except OSError:
            pass
        s.settimeout(5)
        reply = s.recv(4096)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 4"), reply
        s.close()


def test_a_whole_head_of_64_kb_or_1000_headers_is_refused_and_15_kb_passes() -> None:
    """h11 bounds a head only while it is incomplete: one sent whole passed at any size."""
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    with running_server(HeadLimit(_app())) as port:
        many = get + b"".join(b"X-H%d: a\r\n" % i for i in range(1000)) + b"\r\n"
        assert len(many) < MAX_HEADER_BYTES  # h11 parses it whole: the count is what refuses
        assert status_line(port, many, 5) == b"HTTP/1.1 431 Request Header Fields Too Large"
        big = get + b"X-Big: " + b"a" * (64 * 1024) + b"\r\n\r\n"
        assert status_line(port, big, 5).startswith(b"HTTP/1.1 4")  # 431, or h11's 400 if split
        fits = get + b"X-Big: " + b"a" * (15 * 1024) + b"\r\n\r\n"
        assert status_line(port, fits, 5) == b"HTTP/1.1 200 OK"


def test_the_head_limit_names_the_bytes_and_the_bound() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send_):  # never reached
        raise AssertionError("the app saw a head over the limit")

    scope = {"type": "http", "method": "GET", "raw_path": b"/", "headers": [(b"x", b"a" * 20000)]}
    asyncio.run(HeadLimit(app)(scope, None, send))
    assert sent[0]["status"] == 431
    message = sent[1]["body"].decode()
    assert "20" in message and f"at most {MAX_HEADER_BYTES}" in message
