"""A state machine over the handshake (Hypothesis): against one listening rank, any interleaving
of real peers, wrong secrets, replayed transcripts of an earlier real handshake, random frames
and connections dropped part-way leaves the listener serving, hands a channel only to a peer that
proved the secret in this session, records only typed protocol errors, and stays bounded in
threads, pending connections, refusal records and memory. Real loopback sockets."""

from __future__ import annotations

import socket
import threading
import time

import psutil
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.transport.endpoints import ConnectTimeoutError, Listener, connect
from tandem.transport.handshake import AuthError, Identity
from tandem.wire import dtypes
from tandem.wire import frame as fr

SECRET = b"state-machine-secret"
TYPED = (
    "AuthError", "ClaimMismatchError", "HandshakeError", "BadMagicError", "VersionMismatchError",
    "FrameFormatError", "FrameLengthError", "FrameTooLargeError", "PeerClosedError",
    "PeerTimeoutError",
)  # fmt: skip


class _Recorder:
    """A one-connection TCP proxy in front of the listener that keeps what the client sent."""

    def __init__(self, target: int) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.sent = bytearray()
        threading.Thread(target=self._run, args=(target,), daemon=True).start()

    def _run(self, target: int) -> None:
        client, _ = self.srv.accept()
        upstream = socket.create_connection(("127.0.0.1", target))

        def pump(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
            try:
                while data := src.recv(65536):
                    if keep is not None:
                        keep += data
                    dst.sendall(data)
            except OSError:
                pass
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        t = threading.Thread(target=pump, args=(upstream, client, None), daemon=True)
        t.start()
        pump(client, upstream, self.sent)
        t.join(5)
        for s in (client, upstream, self.srv):
            s.close()


def _frames(raw: bytes) -> list[bytes]:
    """Split a recorded client stream into its handshake frames (HELLO, AUTH)."""
    out, at = [], 0
    while at + fr.FIXED_SIZE <= len(raw):
        h, ndim = fr.decode_fixed(raw[at : at + fr.FIXED_SIZE])
        end = at + fr.FIXED_SIZE + 8 * ndim + h.payload_len
        out.append(raw[at:end])
        at = end
    return out


class HandshakeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lis = Listener("127.0.0.1", 0, Identity("c", 0, 2), SECRET, preauth_deadline_s=2.0)
        self.channels: list = []
        self.legit = 0  # handshakes a real peer completed
        self.transcript: list[bytes] | None = None
        self.stop = threading.Event()
        self.me = psutil.Process()
        self.threads0 = self.me.num_threads()
        self.rss0 = self.me.memory_info().rss
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.channels.append(self.lis.accept({1}, timeout=0.5, op_timeout=5))
            except ConnectTimeoutError:
                continue
            except OSError:
                return

    def _await_channels(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.channels) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    @rule()
    def a_real_peer_connects(self) -> None:
        ch = connect("127.0.0.1", self.lis.port, Identity("c", 1, 2), SECRET, expect_rank=0,
                     handshake_timeout=10)  # fmt: skip
        self.legit += 1
        self._await_channels(self.legit)
        ch.close()

    @rule()
    def a_real_peer_is_recorded(self) -> None:
        rec = _Recorder(self.lis.port)
        ch = connect("127.0.0.1", rec.port, Identity("c", 1, 2), SECRET, expect_rank=0,
                     handshake_timeout=10)  # fmt: skip
        self.legit += 1
        self._await_channels(self.legit)
        ch.close()
        deadline = time.monotonic() + 5
        while len(_frames(bytes(rec.sent))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.transcript = _frames(bytes(rec.sent))[:2]

    @rule()
    def a_peer_with_the_wrong_secret(self) -> None:
        try:
            connect("127.0.0.1", self.lis.port, Identity("c", 1, 2), b"wrong", expect_rank=0,
                    handshake_timeout=5)  # fmt: skip
        except AuthError:
            return
        raise AssertionError("a wrong secret was accepted")

    @precondition(lambda self: self.transcript is not None)
    @rule()
    def a_recorded_handshake_is_replayed(self) -> None:
        hello, auth = self.transcript
        event("replayed a recorded handshake")
        refusals = sum("AuthError" in r for r in self.lis.refused)
        with socket.create_connection(("127.0.0.1", self.lis.port), timeout=5) as s:
            s.sendall(hello)
            try:
                s.recv(4096)  # the listener's HELLO, with a fresh nonce the old AUTH cannot match
                s.sendall(auth)
                while s.recv(4096):
                    pass
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while sum("AuthError" in r for r in self.lis.refused) == refusals:
            assert time.monotonic() < deadline, "the replay was not refused as an AuthError"
            time.sleep(0.01)

    @rule(data=st.binary(max_size=300), as_hello=st.booleans())
    def random_bytes_or_a_random_hello(self, data: bytes, as_hello: bool) -> None:
        if as_hello:  # a well-formed HELLO frame around a random body
            head = fr.encode_header(fr.HELLO, fr.HANDSHAKE, dtypes.UINT8.code, 0, 0, (len(data),))
            data = head + data
        with socket.create_connection(("127.0.0.1", self.lis.port), timeout=5) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except OSError:
                pass

    @rule(cut=st.integers(0, 200))
    def a_connection_dropped_part_way(self, cut: int) -> None:
        hello = fr.encode_header(fr.HELLO, fr.HANDSHAKE, dtypes.UINT8.code, 0, 0, (300,))
        with socket.create_connection(("127.0.0.1", self.lis.port), timeout=5) as s:
            s.sendall((hello + b"{" * 300)[:cut])

    @invariant()
    def only_real_peers_got_channels_and_only_typed_errors_were_recorded(self) -> None:
        time.sleep(0.02)
        assert len(self.channels) <= self.legit, (len(self.channels), self.legit)
        for why in self.lis.refused:
            assert any(t in why for t in TYPED), why
        assert len(self.lis.refused) <= 64 and self.lis.pending <= self.lis.max_pending

    def teardown(self) -> None:
        self.stop.set()
        deadline = time.monotonic() + 5  # cut drips run out their 2 s pre-auth deadline
        while self.lis.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.channels) == self.legit
        self.lis.close()
        for ch in self.channels:
            ch.close()
        assert self.me.num_threads() - self.threads0 <= 4
        assert self.me.memory_info().rss - self.rss0 < 10 << 20


HandshakeMachine.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_handshake_state_machine = HandshakeMachine.TestCase
