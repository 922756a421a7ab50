"""Timed, non-blocking socket I/O: exact sends and receives, and a full-duplex send+receive loop.

Every wait is bounded by a no-progress timeout: if no byte moves for `timeout` seconds, the call
raises PeerTimeoutError; a peer that closes or resets raises PeerClosedError. A big send never
waits for the peer to drain before we read, because `Duplex` interleaves both directions in one
poll loop (so N ranks all sending into full socket buffers cannot deadlock).
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Sequence

_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
_OUT = select.POLLOUT | select.POLLERR | select.POLLHUP


class TransportError(ConnectionError):
    """Base of every transport failure."""


class PeerClosedError(TransportError):
    """The peer closed or reset the connection."""


class PeerTimeoutError(TransportError, TimeoutError):
    """No byte moved for the per-op timeout: the peer is stalled, partitioned or dead."""


def prepare(sock: socket.socket) -> socket.socket:
    """A connected TCP socket ready for framed I/O: non-blocking, Nagle off, keepalive on."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


class TimedSocket:
    """A non-blocking socket plus two poll objects; `peer` names the other end in errors."""

    __slots__ = ("sock", "peer", "timeout", "_pin", "_pout")

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self.sock, self.peer, self.timeout = prepare(sock), peer, timeout
        self._pin = select.poll()
        self._pin.register(sock, _IN)
        self._pout = select.poll()
        self._pout.register(sock, _OUT)

    def _stalled(self, what: str) -> PeerTimeoutError:
        return PeerTimeoutError(f"{self.peer}: no progress {what} for {self.timeout:g} s")

    def wait_readable(self) -> None:
        if not self._pin.poll(self.timeout * 1000):
            raise self._stalled("receiving")

    def send_all(self, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send every byte of `bufs` in order (one sendmsg in the common case)."""
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError:
                if not self._pout.poll(self.timeout * 1000):
                    raise self._stalled("sending") from None
                continue
            except OSError as e:
                raise PeerClosedError(f"{self.peer}: connection lost while sending ({e})") from e
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly."""
        view = view.cast("B") if view.format != "B" else view
        got, n = 0, len(view)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except BlockingIOError:
                self.wait_readable()
                continue
            except OSError as e:
                raise PeerClosedError(f"{self.peer}: connection lost while receiving ({e})") from e
            if k == 0:
                raise PeerClosedError(f"{self.peer}: peer closed the connection")
            got += k

    def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return buf

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Duplex:
    """Full duplex over a pair of sockets: queued sends to `out` progress while `recv_into` fills
    buffers from `inp`, so ranks that all send large frames at once never deadlock.

    Queued buffers must stay unchanged until `flush` returns (or a later `recv_into` drains them).
    """

    __slots__ = ("out", "inp", "views")

    def __init__(self, out: TimedSocket, inp: TimedSocket) -> None:
        self.out, self.inp = out, inp
        self.views: list[memoryview] = []

    def send(self, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
        """Queue `bufs` behind earlier sends and push as much as the socket takes now."""
        self.views.extend(memoryview(b).cast("B") for b in bufs if len(b))
        self._push()

    def _push(self) -> bool:
        views = self.views
        if not views:
            return False
        try:
            sent = self.out.sock.sendmsg(views)
        except BlockingIOError:
            return False
        except OSError as e:
            raise PeerClosedError(f"{self.out.peer}: connection lost while sending ({e})") from e
        moved = sent > 0
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        return moved

    def _wait(self, want_in: bool, last: float) -> None:
        if want_in and not self.views:  # the common case: only waiting to receive
            remaining = self.inp.timeout - (time.monotonic() - last)
            if remaining <= 0 or not self.inp._pin.poll(remaining * 1000):
                raise PeerTimeoutError(f"{self.inp.peer}: no progress for {self.inp.timeout:g} s")
            return
        masks: dict[int, int] = {}
        if self.views:
            masks[self.out.sock.fileno()] = _OUT
        if want_in:
            fd = self.inp.sock.fileno()
            masks[fd] = masks.get(fd, 0) | _IN
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        remaining = self.out.timeout - (time.monotonic() - last)
        if remaining <= 0 or not poller.poll(remaining * 1000):
            peer = self.inp.peer if want_in else self.out.peer
            raise PeerTimeoutError(f"{peer}: no progress for {self.out.timeout:g} s")

    def recv_into(self, view: memoryview, on_progress: Callable[[int], None] | None = None) -> None:
        """Fill `view` from `inp`, pushing queued sends meanwhile; `on_progress(bytes_so_far)`
        runs after each receive so a caller can reduce finished segments as bytes arrive."""
        view = view.cast("B") if view.format != "B" else view
        got, want = 0, len(view)
        last = time.monotonic()
        sock = self.inp.sock
        while got < want:
            moved = self._push() if self.views else False
            try:
                k = sock.recv_into(view[got:])
            except BlockingIOError:
                k = -1
            except OSError as e:
                raise PeerClosedError(
                    f"{self.inp.peer}: connection lost while receiving ({e})"
                ) from e
            if k == 0:
                raise PeerClosedError(f"{self.inp.peer}: peer closed the connection")
            if k > 0:
                got += k
                if on_progress is not None:
                    on_progress(got)
                last = time.monotonic()
            elif moved:
                last = time.monotonic()
            else:
                self._wait(True, last)

    def flush(self) -> None:
        """Block until every queued byte is handed to the kernel."""
        last = time.monotonic()
        while self.views:
            if self._push():
                last = time.monotonic()
            elif self.views:
                self._wait(False, last)
