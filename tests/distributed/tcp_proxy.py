"""A TCP proxy for fault tests: forwards one link between two ranks until told to blackhole it.

    proxy = BlackholeProxy(("127.0.0.1", upstream_port))   # listens on 127.0.0.1:proxy.port
    ...                                                      # dialers connect to proxy.port
    proxy.blackhole()     # from now on nothing is forwarded either way; every socket stays open
    proxy.close()

A blackholed link is what a pulled cable or a sleeping laptop looks like to both ends: no FIN, no
RST, the connection stays "up" and simply carries nothing. The pumps stop reading (so the
sender's kernel buffers fill, as with a peer that stops ACKing) and forward nothing they hold.
Threads only; every thread is a daemon and `close` ends them within a poll interval.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_POLL_S = 0.05


class BlackholeProxy:
    """Listens on 127.0.0.1 (an ephemeral port, `.port`) and forwards each accepted connection
    to `upstream` until `blackhole()`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port = self._listener.getsockname()[1]
        self._dark = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.forwarded = 0  # bytes forwarded, both directions
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def blackhole(self) -> None:
        """Forward nothing from now on; keep every connection open."""
        self._dark.set()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in [self._listener, *socks]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=5.0)
            except OSError:
                down.close()
                continue
            with self._lock:
                self._socks += [down, up]
            up.settimeout(None)
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._stop.is_set():
            if self._dark.is_set():  # hold the socket open, read nothing, send nothing
                self._stop.wait(_POLL_S)
                continue
            try:
                ready, _, _ = select.select([src], [], [], _POLL_S)
                if not ready:
                    continue
                data = src.recv(65536)
            except (OSError, ValueError):  # closed under us
                return
            if not data or self._dark.is_set():
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                continue  # the link went dark while this chunk was in flight: it is lost
            try:
                dst.sendall(data)
            except OSError:
                return
            with self._lock:
                self.forwarded += len(data)
