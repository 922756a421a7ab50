"""Hostile clients for the e2e fault suite: slow-drip connections and a connection flood against
whatever a process tree listens on. Threads and raw sockets; every socket is closed by `stop`."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import psutil

from tandem.wire import dtypes
from tandem.wire import frame as fr

HTTP_DRIP = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64  # never ends
# a valid HELLO header announcing a body: the listener waits for more
FRAME_DRIP = fr.encode_header(fr.HELLO, fr.HANDSHAKE, dtypes.UINT8.code, 0, 0, (512,))


def listening_ports(pids: list[int]) -> list[int]:
    """The TCP ports any of `pids` listens on."""
    out: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.add(c.laddr.port)
    return sorted(out)


def _closed(s: socket.socket) -> bool:
    """The server closed (or reset) `s`: readable with nothing, or an error."""
    try:
        ready, _, _ = select.select([s], [], [], 0)
        if not ready:
            return False
        return s.recv(65536, socket.MSG_DONTWAIT) == b"" or False
    except BlockingIOError:
        return False
    except OSError:
        return True


class Drip(threading.Thread):
    """Connects to `port` and sends `payload` one byte every `every_s` until the server closes
    the connection (`cut_after_s`: seconds from connect) or `stop()`."""

    def __init__(
        self, port: int, payload: bytes, every_s: float = 1.0, source: str = "127.0.0.1"
    ) -> None:
        super().__init__(daemon=True)
        self.port, self.payload, self.every_s, self.source = port, payload, every_s, source
        self.cut_after_s: float | None = None
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            s = socket.create_connection(
                ("127.0.0.1", self.port), timeout=5, source_address=(self.source, 0)
            )
        except OSError as e:  # refused at the door counts as cut at once
            self.cut_after_s, self.error = 0.0, str(e)
            return
        t0 = time.monotonic()
        with s:
            for i in range(10**6):
                if self._halt.wait(0 if i == 0 else self.every_s):
                    return
                try:
                    s.sendall(self.payload[i % len(self.payload) : i % len(self.payload) + 1])
                except OSError:
                    break
                if _closed(s):
                    break
            self.cut_after_s = time.monotonic() - t0

    def stop(self) -> None:
        self._halt.set()


class Flood:
    """`n` connections to `port` from `source`, each sending `hello` and then nothing."""

    def __init__(self, port: int, n: int, hello: bytes, source: str = "127.0.0.1") -> None:
        self.socks: list[socket.socket] = []
        self.refused = 0  # connections the server would not even complete
        for _ in range(n):
            if self.refused >= 5:  # a full backlog: the rest would wait out their connects
                break
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.bind((source, 0))
                s.connect(("127.0.0.1", port))
                s.sendall(hello)
            except OSError:
                self.refused += 1
                s.close()
                continue
            self.socks.append(s)

    def open_count(self) -> int:
        """Connections the server still holds open."""
        return sum(not _closed(s) for s in self.socks)

    def stop(self) -> None:
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
        self.socks = []
