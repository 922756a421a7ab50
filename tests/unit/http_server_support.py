"""A real uvicorn server in a thread, on a loopback port, with the limits `tandem serve` uses
(`tandem.server.http_limits`), for tests that speak raw sockets or HTTP to it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from tandem.server import http_limits


@contextlib.contextmanager
def running_server(app: Any, **overrides: Any) -> Iterator[int]:
    """Serves `app` until the block ends; yields the port. `overrides` replace uvicorn options."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    opts = {**http_limits.uvicorn_options(), **overrides}
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **opts)
    server = uvicorn.Server(config)
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        th.join(10)
        sock.close()
