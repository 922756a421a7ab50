"""A raw HTTP request head written to a server's socket, for the header-limit tests (tests/unit/
test_http_limits.py in process, tests/e2e/test_serve_exposure.py against `tandem serve`)."""

import socket


def status_line(port: int, head: bytes, timeout_s: float) -> bytes:
    """The status line the server at 127.0.0.1:`port` answers `head` with (b"" if it closed
    without one; a server may close while `head` is still being written)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(head)
        except OSError:
            pass
        try:
            return s.recv(4096).split(b"\r\n", 1)[0]
        except OSError:
            return b""
