"""Opening authenticated channels: `connect` (dial with retry and backoff) and `Listener` (accept).

Peers start unevenly (a slow GPU driver, a model still loading), so a dialer retries with
exponential backoff until the handshake timeout (default 120 s; the paper's 10 s raced start-up).
A listener keeps serving after a bad connection: a stray client, random bytes, a wrong secret or a
wrong version is refused and closed, and the listener goes on to accept its real peers.
Without a secret, only loopback peers are accepted and only loopback peers are dialed.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import time
from collections.abc import Callable

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
DEFAULT_MAX_FRAME_BYTES = 4 << 30


class ConnectTimeoutError(TransportError, TimeoutError):
    """No authenticated peer within the handshake timeout."""


class InsecurePeerError(TransportError):
    """A non-loopback peer without a cluster secret."""


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
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
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
    """A bound, listening socket that hands out authenticated channels, one per accepted peer."""

    def __init__(self, host: str, port: int, me: Identity, secret: bytes | None) -> None:
        self.me, self.secret = me, secret
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.sock.setblocking(False)
        self.host = host
        self.refused: list[str] = []  # why each bad connection was dropped, for tests and logs

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

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
        while True:
            remaining = deadline - time.monotonic()
            if give_up is not None and (reason := give_up()) is not None:
                raise reason
            if remaining > 0 and not poller.poll(min(remaining, 0.5) * 1000):
                continue
            if remaining <= 0:
                raise ConnectTimeoutError(
                    f"rank {self.me.rank}: no peer of rank {sorted(expect_ranks or [])} "
                    f"authenticated on port {self.port} within {timeout:g} s "
                    f"(refused: {self.refused[-3:]})"
                )
            try:
                sock, addr = self.sock.accept()
            except BlockingIOError:
                continue
            peer_host = addr[0]
            if not self.secret and not is_loopback(peer_host):
                sock.close()
                self.refused.append(f"{peer_host}: non-loopback peer and no cluster secret")
                log.warning("refused %s: no cluster secret, only loopback peers allowed", peer_host)
                continue
            ts = TimedSocket(
                sock, f"{peer_host}:{addr[1]}", min(HELLO_TIMEOUT_S, max(remaining, 0.1))
            )
            try:
                peer = acceptor_handshake(ts, self.me, self.secret, expect_ranks)
            except fr.VersionMismatchError as e:
                self._refuse_version(ts, e)
                continue
            except (HandshakeError, TransportError, fr.FrameError) as e:
                ts.close()
                self.refused.append(f"{peer_host}: {_refusal_reason(e)}")
                log.warning("refused %s: %s", peer_host, e)
                continue
            ts.timeout = op_timeout
            ts.peer = f"rank {peer.rank} ({peer_host})"
            return Channel(ts, self.me, peer, max_frame_bytes)

    def _refuse_version(self, ts: TimedSocket, e: Exception) -> None:
        # Answer in our own version: the peer's decoder then names both versions.
        self.refused.append(f"{ts.peer}: {_refusal_reason(e)}")
        log.warning("refused %s: %s", ts.peer, e)
        try:
            head = fr.encode_header(fr.HELLO, fr.HANDSHAKE, 6, 0, 0, (2,))
            ts.send_all([head, b"{}"])
            ts.sock.shutdown(socket.SHUT_WR)
            ts.sock.recv(1 << 16)  # drain what the peer already sent, so close() does not reset
        except (TransportError, OSError):
            pass
        ts.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
