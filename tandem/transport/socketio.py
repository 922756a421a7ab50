"""Timed, non-blocking socket I/O: exact sends and receives, and full duplex (`Duplex`).

Every wait is bounded by a no-progress timeout: if no byte moves for `timeout` seconds, the call
raises PeerTimeoutError; a peer that closes or resets raises PeerClosedError. A big send never
waits for the peer to drain before we read: `Duplex` hands what the kernel cannot take at once to
a sender thread while the caller receives (so N ranks all sending into full socket buffers cannot
deadlock, and the two directions' copies overlap on two cores).

A `deadline` (a `time.monotonic()` instant, None by default) bounds the whole exchange on top of
the no-progress timeout: pre-authentication phases set one, so a client that drips a byte just
inside each timeout still runs out of time (PeerTimeoutError).

Receives spin before they block: a receiver that finds no bytes first polls without sleeping for
up to `spin` seconds (env TANDEM_SPIN_US, microseconds, default 500; 0 disables), then blocks in
poll as before. A rank that reaches a collective first thus sees its peer's bytes within
microseconds instead of paying the wake-up latency of a blocked poll. The spin counts against the
no-progress timeout: a stalled peer times out after the same `timeout` seconds either way.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
_OUT = select.POLLOUT | select.POLLERR | select.POLLHUP

SPIN_ENV = "TANDEM_SPIN_US"
_sched_yield = getattr(os, "sched_yield", lambda: None)  # not on every platform
DEFAULT_SPIN_US = 500


def spin_from_env(name: str = SPIN_ENV, default_us: int = DEFAULT_SPIN_US) -> float:
    """Seconds a receive spins before it blocks: env `name` (microseconds; TANDEM_SPIN_US,
    default 500, for TCP receives; `transport.shm` reads its own)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default_us / 1e6
    try:
        us = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected whole microseconds (0 disables)") from None
    if us < 0:
        raise ValueError(f"{name}={raw!r}: must be >= 0")
    return us / 1e6


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
    """A non-blocking socket plus two poll objects; `peer` names the other end in errors.
    `spin`: seconds a receive polls without sleeping before it blocks (None: from TANDEM_SPIN_US).
    `deadline`: a monotonic instant past which every wait fails (None: no total bound)."""

    __slots__ = ("sock", "peer", "timeout", "spin", "deadline", "_pin", "_pout")

    def __init__(
        self, sock: socket.socket, peer: str, timeout: float, spin: float | None = None
    ) -> None:
        self.sock, self.peer, self.timeout = prepare(sock), peer, timeout
        self.spin = spin_from_env() if spin is None else max(0.0, spin)
        self.deadline: float | None = None
        self._pin = select.poll()
        self._pin.register(sock, _IN)
        self._pout = select.poll()
        self._pout.register(sock, _OUT)

    def _stalled(self, what: str) -> PeerTimeoutError:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return PeerTimeoutError(f"{self.peer}: ran past its deadline {what}")
        return PeerTimeoutError(f"{self.peer}: no progress {what} for {self.timeout:g} s")

    def _wait_s(self) -> float:
        """How long the next wait may block: the no-progress timeout, cut at the deadline."""
        if self.deadline is None:
            return self.timeout
        return max(0.0, min(self.timeout, self.deadline - time.monotonic()))

    def spin_readable(self, budget: float) -> bool:
        """Poll without sleeping for up to `budget` seconds; True once the socket is readable.
        Each turn yields the core (`sched_yield`): alone on its core the spinner goes straight
        back to polling, but on an oversubscribed machine (more ranks than cores) the rank it is
        waiting for gets to run instead of waiting out the spin."""
        if budget <= 0:
            return False
        poll, end, yield_ = self._pin.poll, time.monotonic() + budget, _sched_yield
        while True:
            if poll(0):
                return True
            if time.monotonic() >= end:
                return False
            yield_()

    def wait_readable(self) -> None:
        """Return once readable; PeerTimeoutError after `timeout` s (spin included) without, or
        at the deadline."""
        budget = self._wait_s()
        if self.spin <= 0:
            if budget <= 0 or not self._pin.poll(budget * 1000):
                raise self._stalled("receiving")
            return
        start = time.monotonic()
        if self.spin_readable(min(self.spin, budget)):
            return
        remaining = budget - (time.monotonic() - start)
        if remaining <= 0 or not self._pin.poll(remaining * 1000):
            raise self._stalled("receiving")

    def send_all(self, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send every byte of `bufs` in order (one sendmsg in the common case)."""
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError:
                budget = self._wait_s()
                if budget <= 0 or not self._pout.poll(budget * 1000):
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
    """Full duplex over a pair of sockets: what `send` cannot hand to the kernel at once is sent by
    a background thread while `recv_into` fills buffers from `inp`, so ranks that all send large
    frames at once never deadlock, and sending and receiving overlap on two cores.

    Small sends (the latency path) go out inline from the caller's thread. Queued buffers must stay
    unchanged until `flush` returns. A send failure is re-raised by the next call.
    """

    def __init__(self, out: TimedSocket, inp: TimedSocket) -> None:
        self.out, self.inp = out, inp
        self._cv = threading.Condition()
        self._queue: deque[memoryview] = deque()
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def send(self, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send `bufs` after everything queued before; returns once they are queued."""
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        with self._cv:
            self._check()
            if not self._queue and not self._busy:
                try:
                    sent = self.out.sock.sendmsg(views)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    raise PeerClosedError(
                        f"{self.out.peer}: connection lost while sending ({e})"
                    ) from e
                while sent:
                    if sent >= len(views[0]):
                        sent -= len(views[0])
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
            if views:
                self._queue.extend(views)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._sender, name="tandem-send", daemon=True
                    )
                    self._thread.start()
                self._cv.notify_all()

    def send_small(self, head: bytes, payload: Any) -> None:
        """`send([head, payload])` for the latency path: when nothing is queued (only this thread
        queues, so the check needs no lock) it is one sendmsg from this thread; otherwise, or for
        whatever the kernel does not take at once, `send`. `payload`: a buffer with `nbytes`
        (a numpy array or memoryview)."""
        if self._queue or self._busy or self._error is not None:
            self.send((head, payload))
            return
        try:
            sent = self.out.sock.sendmsg((head, payload))
        except BlockingIOError:
            sent = 0
        except OSError as e:
            raise PeerClosedError(f"{self.out.peer}: connection lost while sending ({e})") from e
        if sent < len(head) + payload.nbytes:  # rare: the socket buffer was full
            rest = memoryview(head + memoryview(payload).cast("B").tobytes())[sent:]
            self.send((rest,))

    def recv_small(self, view: memoryview, check: Callable[[int], None]) -> None:
        """`recv_into(view, check)` for the latency path: one recv_into first, which usually
        brings the whole frame; `check(bytes_so_far)` runs after it either way."""
        try:
            got = self.inp.sock.recv_into(view)
        except BlockingIOError:
            got = -1
        except OSError as e:
            raise PeerClosedError(f"{self.inp.peer}: connection lost while receiving ({e})") from e
        if got == len(view):
            check(got)
            return
        if got == 0:
            raise PeerClosedError(f"{self.inp.peer}: peer closed the connection")
        if got > 0:
            check(got)
            view = view[got:]
            base = got
            self.recv_into(view, lambda k: check(base + k))
        else:
            self.recv_into(view, check)

    def _sender(self) -> None:
        sock, out = self.out.sock, self.out
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                self._busy = True  # before the queue empties: `flush` reads both without the lock
                views = list(self._queue)
                self._queue.clear()
            try:
                last = time.monotonic()
                while views:
                    try:
                        sent = sock.sendmsg(views)
                    except BlockingIOError:
                        remaining = out.timeout - (time.monotonic() - last)
                        if remaining <= 0 or not out._pout.poll(remaining * 1000):
                            raise out._stalled("sending") from None
                        continue
                    except OSError as e:
                        raise PeerClosedError(
                            f"{out.peer}: connection lost while sending ({e})"
                        ) from e
                    last = time.monotonic()
                    while sent:
                        if sent >= len(views[0]):
                            sent -= len(views[0])
                            views.pop(0)
                        else:
                            views[0] = views[0][sent:]
                            sent = 0
            except BaseException as e:
                with self._cv:
                    self._error = e
                    self._busy = False
                    self._queue.clear()
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def recv_into(self, view: memoryview, on_progress: Callable[[int], None] | None = None) -> None:
        """Fill `view` from `inp` while queued sends proceed; `on_progress(bytes_so_far)` runs
        after each receive so a caller can reduce finished segments as bytes arrive."""
        view = view.cast("B") if view.format != "B" else view
        got, want = 0, len(view)
        sock, inp = self.inp.sock, self.inp
        spin = inp.spin
        last = time.monotonic()
        while got < want:
            if self._error is not None:
                raise self._error
            try:
                k = sock.recv_into(view[got:])
            except BlockingIOError:
                # spin first (not while the sender thread needs the GIL and a core)
                if spin > 0 and not self._busy and not self._queue:
                    budget = min(spin, inp.timeout - (time.monotonic() - last))
                    if inp.spin_readable(budget):
                        continue
                remaining = inp.timeout - (time.monotonic() - last)
                # wake at least once a second to notice a failed sender
                if remaining <= 0 or (
                    not inp._pin.poll(min(remaining, 1.0) * 1000) and remaining <= 1.0
                ):
                    raise inp._stalled("receiving") from None
                continue
            except OSError as e:
                raise PeerClosedError(f"{inp.peer}: connection lost while receiving ({e})") from e
            if k == 0:
                raise PeerClosedError(f"{inp.peer}: peer closed the connection")
            got += k
            last = time.monotonic()
            if on_progress is not None:
                on_progress(got)

    def flush(self) -> None:
        """Block until every queued byte is handed to the kernel (or the sender fails)."""
        if not self._queue and not self._busy and self._error is None:
            return  # nothing pending: only this thread queues, and the sender sets busy first
        with self._cv:
            while (self._queue or self._busy) and self._error is None:
                self._cv.wait(1.0)
            self._check()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
