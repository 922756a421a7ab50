"""TCP forwarders for fault tests: they carry links between ranks until told to blackhole them.

    proxy = BlackholeProxy(("127.0.0.1", upstream_port))   # listens on 127.0.0.1:proxy.port
    ...                                                      # dialers connect to proxy.port
    proxy.blackhole()     # from now on nothing is forwarded either way; every socket stays open
    proxy.close()

    relay = Relay()                                          # listens on 127.0.0.1:relay.port
    os.environ["TANDEM_TEST_RELAY"] = relay.route("1")       # rank 1's links dial through it
    ...                                                      # (`tandem.transport.relay_seam`)
    relay.blackhole()     # every connection open now goes dark; later ones are forwarded
    relay.close()

A blackholed link is what a pulled cable, a firewall DROP rule or a sleeping laptop looks like to
both ends: no FIN, no RST, the connection stays "up" and simply carries nothing. The pumps stop
reading (so the sender's kernel buffers fill, as with a peer that stops ACKing) and forward nothing
they hold. `BlackholeProxy` forwards every connection to one fixed address; `Relay` forwards each
to the address its dialer names in a first line ("HOST PORT\\n"), so it can stand on links whose
ports are ephemeral (heartbeat connections, a pipeline's stage links). A connection the relay
accepts after `blackhole()` is forwarded: the group formed again after the loss gets through, as
over a new cable. Threads only; every thread is a daemon and `close` ends them within a poll
interval.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_POLL_S = 0.05
_MAX_LINE = 300  # "HOST PORT\n"


class _Forwarder:
    """Accepts on 127.0.0.1 (an ephemeral port, `.port`) and pumps each connection both ways to
    the address `_upstream_of` gives it, until its `dark` event is set."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._darks: list[threading.Event] = []
        self.forwarded = 0  # bytes forwarded, both directions
        self.destinations: list[tuple[str, int]] = []  # of every connection forwarded
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _upstream_of(self, down: socket.socket) -> tuple[str, int] | None:
        raise NotImplementedError

    def _dark_for_new(self) -> threading.Event:
        return threading.Event()

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
            threading.Thread(target=self._open, args=(down,), daemon=True).start()

    def _open(self, down: socket.socket) -> None:
        try:
            upstream = self._upstream_of(down)
            up = socket.create_connection(upstream, timeout=5.0) if upstream else None
        except OSError:
            up = None
        if up is None:  # refused: the dialer retries, as against the real listener
            down.close()
            return
        up.settimeout(None)
        down.settimeout(None)
        dark = self._dark_for_new()
        with self._lock:
            self._socks += [down, up]
            self._darks.append(dark)
            self.destinations.append(upstream)
        for a, b in ((down, up), (up, down)):
            threading.Thread(target=self._pump, args=(a, b, dark), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, dark: threading.Event) -> None:
        while not self._stop.is_set():
            if dark.is_set():  # hold the socket open, read nothing, send nothing
                self._stop.wait(_POLL_S)
                continue
            try:
                ready, _, _ = select.select([src], [], [], _POLL_S)
                if not ready:
                    continue
                data = src.recv(65536)
            except (OSError, ValueError):  # closed under us
                return
            if not data or dark.is_set():
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


class BlackholeProxy(_Forwarder):
    """Listens on 127.0.0.1 (an ephemeral port, `.port`) and forwards each accepted connection
    to `upstream` until `blackhole()`; from then on every connection, old or new, is dark."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._dark = threading.Event()
        super().__init__()

    def _upstream_of(self, down: socket.socket) -> tuple[str, int]:
        return self.upstream

    def _dark_for_new(self) -> threading.Event:
        return self._dark

    def blackhole(self) -> None:
        """Forward nothing from now on; keep every connection open."""
        self._dark.set()


class Relay(_Forwarder):
    """Forwards each connection to the address named in its first line (the dialer's side is
    `tandem.transport.relay_seam`), until `blackhole()` darkens the connections open then."""

    def route(self, ranks: str) -> str:
        """The TANDEM_TEST_RELAY value that sends the links of `ranks` ("A" or "A-B") here."""
        return f"127.0.0.1:{self.port}/{ranks}"

    def blackhole(self) -> int:
        """Every connection open now forwards nothing from now on and stays open; returns how
        many went dark."""
        with self._lock:
            darks = list(self._darks)
        for dark in darks:
            dark.set()
        return len(darks)

    def _upstream_of(self, down: socket.socket) -> tuple[str, int] | None:
        down.settimeout(5.0)
        line = b""
        while not line.endswith(b"\n") and len(line) < _MAX_LINE:
            got = down.recv(1)  # byte by byte: what follows the line is the handshake's
            if not got:
                return None
            line += got
        host, _, port = line.decode(errors="replace").strip().rpartition(" ")
        return (host, int(port)) if host and port.isdigit() else None
