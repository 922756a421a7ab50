"""Opening authenticated channels: `connect` (dial with retry and backoff) and `Listener` (accept).

Peers start unevenly (a slow GPU driver, a model still loading), so a dialer retries with
exponential backoff until the handshake timeout (default 120 s; the paper's 10 s raced start-up).
A listener keeps serving after a bad connection: a stray client, random bytes, a wrong secret or a
wrong version is refused and closed, and the listener goes on to accept its real peers. Accepted
connections authenticate concurrently, each under a total deadline, and only so many at once.
Without a secret, only loopback peers are accepted and only loopback peers are dialed.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from tandem.transport import relay_seam
from tandem.transport.channel import Channel
from tandem.transport.handshake import (
    AuthError,
    ClaimMismatchError,
    HandshakeError,
    Identity,
    acceptor_handshake,
    connector_handshake,
)
from tandem.transport.socketio import TimedSocket, TransportError
from tandem.wire import frame as fr

log = logging.getLogger(__name__)

DEFAULT_HANDSHAKE_TIMEOUT_S = 120.0
DEFAULT_OP_TIMEOUT_S = 60.0
HELLO_TIMEOUT_S = 5.0  # a real peer speaks at once; a silent client is dropped after this
PREAUTH_DEADLINE_S = 10.0  # the whole handshake of an accepted connection, however it drips
MAX_PENDING = 32  # connections authenticating at once; more are closed unread
MAX_PENDING_PER_HOST = 8  # of those, from one address
REFUSALS_KEPT = 64
DEFAULT_MAX_FRAME_BYTES = 4 << 30


class ConnectTimeoutError(TransportError, TimeoutError):
    """No authenticated peer within the handshake timeout."""


class InsecurePeerError(TransportError):
    """A non-loopback peer without a cluster secret."""


class ListenerClosedError(TransportError):
    """accept() on a listener that has been closed."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _refusal_reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def connect(
    host: str,
    port: int,
    me: Identity,
    secret: bytes | None,
    *,
    expect_rank: int | None = None,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    op_timeout: float = DEFAULT_OP_TIMEOUT_S,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Channel:
    """Dial host:port until an authenticated channel forms or `handshake_timeout` passes.

    Refused/unreachable connections are retried with backoff (50 ms doubling to 1 s); an
    authentication or claim mismatch is final and raised at once.
    """
    if not secret and not is_loopback(host):
        raise InsecurePeerError(
            f"refusing to dial {host}:{port} without a cluster secret (set TANDEM_SECRET or the "
            f"'secret' field); only loopback peers may skip it"
        )
    deadline = time.monotonic() + handshake_timeout
    delay, last_err = 0.05, "no attempt"
    expect = None if expect_rank is None else {expect_rank}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectTimeoutError(
                f"rank {me.rank}: no authenticated peer of rank {sorted(expect or [])} at "
                f"{host}:{port} within {handshake_timeout:g} s (last error: {last_err})"
            )
        try:
            sock = relay_seam.dial((host, port), me.rank, expect_rank, min(remaining, 5.0))
        except OSError as e:
            last_err = str(e)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)
            continue
        ts = TimedSocket(
            sock, f"rank {me.rank} -> {host}:{port}", min(remaining, HELLO_TIMEOUT_S * 6)
        )
        try:
            peer = connector_handshake(ts, me, secret, expect)
        except (AuthError, ClaimMismatchError, fr.VersionMismatchError):
            ts.close()
            raise
        except (HandshakeError, TransportError, fr.FrameError) as e:
            # e.g. the listener dropped us while busy with another client: try again
            ts.close()
            last_err = _refusal_reason(e)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)
            continue
        ts.timeout = op_timeout
        ts.peer = f"rank {peer.rank} ({host}:{port})"
        return Channel(ts, me, peer, max_frame_bytes)


class Listener:
    """A bound, listening socket that hands out authenticated channels, one per accepted peer.

    Pre-authentication is concurrent and bounded: each accepted connection runs its handshake on
    its own thread under a total deadline (`preauth_deadline_s`, however slowly it drips), and at
    most `max_pending` connections (`max_pending_per_host` from one address) authenticate at once;
    beyond that a new connection is closed unread. A slow or hostile client therefore costs one
    bounded slot for a bounded time and never delays a real peer behind it."""

    def __init__(
        self,
        host: str,
        port: int,
        me: Identity,
        secret: bytes | None,
        *,
        preauth_deadline_s: float = PREAUTH_DEADLINE_S,
        max_pending: int = MAX_PENDING,
        max_pending_per_host: int = MAX_PENDING_PER_HOST,
    ) -> None:
        self.me, self.secret = me, secret
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.sock.setblocking(False)
        self.host = host
        self._port = int(self.sock.getsockname()[1])
        self.preauth_deadline_s = preauth_deadline_s
        self.max_pending, self.max_pending_per_host = max_pending, max_pending_per_host
        # why each bad connection was dropped (the latest REFUSALS_KEPT), for tests and logs
        self.refused: deque[str] = deque(maxlen=REFUSALS_KEPT)
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, str] = {}  # authenticating -> its peer's address
        self._ready: deque[tuple[TimedSocket, Identity, str]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def pending(self) -> int:
        """Connections authenticating right now."""
        with self._lock:
            return len(self._pending)

    def accept(
        self,
        expect_ranks: set[int] | None,
        *,
        timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        op_timeout: float = DEFAULT_OP_TIMEOUT_S,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        give_up: Callable[[], BaseException | None] | None = None,
    ) -> Channel:
        """The next peer that authenticates as one of `expect_ranks`; bad connections are refused
        and skipped. ConnectTimeoutError if none arrives within `timeout`; if `give_up()` returns
        an exception (checked twice a second), that is raised instead of waiting on."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            if give_up is not None and (reason := give_up()) is not None:
                raise reason
            if self._closed:
                raise ListenerClosedError(f"the listener on port {self.port} is closed")
            ch = self._take_ready(expect_ranks, op_timeout, max_frame_bytes)
            if ch is not None:
                return ch
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConnectTimeoutError(
                    f"rank {self.me.rank}: no peer of rank {sorted(expect_ranks or [])} "
                    f"authenticated on port {self.port} within {timeout:g} s "
                    f"(refused: {list(self.refused)[-3:]})"
                )
            for fd, _ in poller.poll(min(remaining, 0.5) * 1000):
                if fd == self._wake_r.fileno():
                    self._drain_wake()
                else:
                    self._accept_waiting(expect_ranks)

    def _take_ready(
        self, expect_ranks: set[int] | None, op_timeout: float, max_frame_bytes: int
    ) -> Channel | None:
        while True:
            with self._lock:
                if not self._ready:
                    return None
                ts, peer, host = self._ready.popleft()
            if expect_ranks is not None and peer.rank not in expect_ranks:
                # authenticated while an earlier accept() wanted it; that rank is taken since
                ts.close()
                self._refuse(host, f"rank {peer.rank} is already connected")
                continue
            ts.timeout = op_timeout
            ts.peer = f"rank {peer.rank} ({host})"
            return Channel(ts, self.me, peer, max_frame_bytes)

    def _accept_waiting(self, expect_ranks: set[int] | None) -> None:
        """Starts a handshake thread for every connection the kernel holds, within the caps."""
        while True:
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. EMFILE under a flood: drop this round, keep listening
                log.warning("accept failed on port %d: %s", self.port, e)
                return
            host = addr[0]
            if not self.secret and not is_loopback(host):
                sock.close()
                self._refuse(host, "non-loopback peer and no cluster secret")
                continue
            with self._lock:
                from_host = sum(1 for h in self._pending.values() if h == host)
                n = len(self._pending)
                admitted = n < self.max_pending and from_host < self.max_pending_per_host
                if admitted:
                    self._pending[sock] = host
            if not admitted:
                sock.close()
                self._refuse(host, f"too many connections authenticating ({n}, {from_host} here)")
                continue
            threading.Thread(
                target=self._authenticate,
                args=(sock, addr, expect_ranks),
                name="tandem-preauth",
                daemon=True,
            ).start()

    def _authenticate(
        self, sock: socket.socket, addr: tuple, expect_ranks: set[int] | None
    ) -> None:
        host = addr[0]
        ts = TimedSocket(sock, f"{host}:{addr[1]}", HELLO_TIMEOUT_S)
        ts.deadline = time.monotonic() + self.preauth_deadline_s
        try:
            peer = acceptor_handshake(ts, self.me, self.secret, expect_ranks)
        except fr.VersionMismatchError as e:
            self._refuse_version(ts, e)
            peer = None
        except Exception as e:  # noqa: BLE001 - whatever a stranger sends, the listener lives
            self._refuse(host, _refusal_reason(e))  # recorded before the stranger sees the close
            ts.close()
            peer = None
        ts.deadline = None
        with self._lock:
            self._pending.pop(sock, None)
            if peer is not None:
                if self._closed:
                    ts.close()
                else:
                    self._ready.append((ts, peer, host))
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed, or full of wake-ups already
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _refuse(self, host: str, why: str) -> None:
        self.refused.append(f"{host}: {why}")
        log.warning("refused %s: %s", host, why)

    def _refuse_version(self, ts: TimedSocket, e: Exception) -> None:
        # Answer in our own version: the peer's decoder then names both versions.
        self._refuse(ts.peer, _refusal_reason(e))
        try:
            head = fr.encode_header(fr.HELLO, fr.HANDSHAKE, 6, 0, 0, (2,))
            ts.send_all([head, b"{}"])
            ts.sock.shutdown(socket.SHUT_WR)
            ts.sock.recv(1 << 16)  # drain what the peer already sent, so close() does not reset
        except (TransportError, OSError):
            pass
        ts.close()

    def close(self) -> None:
        """Stops listening; connections still authenticating are cut, unclaimed channels closed."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), {}
            ready, self._ready = list(self._ready), deque()
        for s in pending:  # wakes the handshake thread's poll: it fails and closes its socket
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for ts, _, _ in ready:
            ts.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
