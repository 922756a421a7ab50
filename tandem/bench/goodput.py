"""A link's TCP round-trip latency and goodput, measured by a plain socket echo server and client.

    python -m tandem.bench.goodput serve --host ADDR          # prints "PORT <n>", serves one client
    python -m tandem.bench.goodput measure --host ADDR --port N [--bytes B] [--pings K]

The client first ping-pongs `pings` 8-byte messages (median round trip), then streams `bytes` of
payload (after an 8-byte length) and waits for the server's 8-byte acknowledgement; goodput is
payload / (stream time - one round trip). It prints one JSON object. Every socket op has a timeout.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import time
from dataclasses import asdict, dataclass

_LEN = struct.Struct("!Q")
_CHUNK = 1 << 20
_TIMEOUT_S = 60.0


class GoodputProtocolError(RuntimeError):
    """The peer sent something other than the echo/stream protocol, or hung up early."""


@dataclass(frozen=True)
class LinkFigures:
    """Measured link figures: median round trip and sustained one-way TCP goodput."""

    rtt_s: float
    goodput_bytes_per_s: float
    payload_bytes: int


def serve(host: str, port: int = 0, out=sys.stdout) -> None:
    with socket.create_server((host, port)) as srv:
        srv.settimeout(_TIMEOUT_S)
        print(f"PORT {srv.getsockname()[1]}", file=out, flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _serve_one(conn)


def _serve_one(conn: socket.socket) -> None:
    (pings,) = _LEN.unpack(_recv_exact(conn, 8))
    for _ in range(pings):
        conn.sendall(_recv_exact(conn, 8))
    (total,) = _LEN.unpack(_recv_exact(conn, 8))
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    left = total
    while left:
        n = conn.recv_into(view, min(left, _CHUNK))
        if n == 0:
            raise GoodputProtocolError(f"client hung up with {left} of {total} bytes unsent")
        left -= n
    conn.sendall(_LEN.pack(total))


def measure(host: str, port: int, payload_bytes: int = 64 << 20, pings: int = 200) -> LinkFigures:
    if payload_bytes <= 0 or pings <= 0:
        raise ValueError("payload_bytes and pings must be positive")
    with socket.create_connection((host, port), timeout=_TIMEOUT_S) as conn:
        conn.settimeout(_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(_LEN.pack(pings))
        rtts = []
        for i in range(pings):
            msg = _LEN.pack(i)
            t0 = time.perf_counter()
            conn.sendall(msg)
            if _recv_exact(conn, 8) != msg:
                raise GoodputProtocolError("echo mismatch")
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        chunk = bytes(_CHUNK)
        t0 = time.perf_counter()
        conn.sendall(_LEN.pack(payload_bytes))
        left = payload_bytes
        while left:
            n = min(left, _CHUNK)
            conn.sendall(chunk[:n])
            left -= n
        (acked,) = _LEN.unpack(_recv_exact(conn, 8))
        elapsed = time.perf_counter() - t0
    if acked != payload_bytes:
        raise GoodputProtocolError(f"server acknowledged {acked} of {payload_bytes} bytes")
    return LinkFigures(rtt, payload_bytes / max(elapsed - rtt, 1e-9), payload_bytes)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = conn.recv(left)
        if not part:
            raise GoodputProtocolError(f"peer hung up with {left} of {n} bytes pending")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.goodput")
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    m = sub.add_parser("measure")
    m.add_argument("--host", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--bytes", type=int, default=64 << 20)
    m.add_argument("--pings", type=int, default=200)
    args = p.parse_args(argv)
    if args.mode == "serve":
        serve(args.host, args.port)
    else:
        print(json.dumps(asdict(measure(args.host, args.port, args.bytes, args.pings))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
