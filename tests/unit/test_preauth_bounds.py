"""Pre-authentication is bounded: what a stranger sends before proving the secret is parsed with
bounded depth and size, finishes within a total deadline however slowly it drips, and occupies at
most a capped number of slots, so the real peer behind it joins at once. Real loopback sockets."""

from __future__ import annotations

import json
import socket
import threading
import time

import psutil

from tandem.transport.endpoints import Listener, connect
from tandem.transport.handshake import Identity
from tandem.wire import dtypes
from tandem.wire import frame as fr

SECRET = b"cluster-secret"


def _accept_in_thread(lis: Listener, out: dict, timeout: float = 20.0) -> threading.Thread:
    def body() -> None:
        try:
            out["channel"] = lis.accept({1}, timeout=timeout, op_timeout=5)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th


def _hello(body: bytes) -> bytes:
    return fr.encode_header(fr.HELLO, fr.HANDSHAKE, dtypes.UINT8.code, 0, 0, (len(body),)) + body


def _real_peer(port: int) -> float:
    t0 = time.monotonic()
    ch = connect(
        "127.0.0.1", port, Identity("c", 1, 2), SECRET, expect_rank=0, handshake_timeout=10
    )
    ch.close()
    return time.monotonic() - t0


def test_a_hello_nesting_2000_brackets_is_refused_and_the_listener_serves_its_peer() -> None:
    lis = Listener("127.0.0.1", 0, Identity("c", 0, 2), SECRET)
    out: dict = {}
    th = _accept_in_thread(lis, out)
    try:
        with socket.create_connection(("127.0.0.1", lis.port), timeout=10) as s:
            s.sendall(_hello(b"[" * 2000 + b"]" * 2000))
            s.settimeout(10)
            assert s.recv(1) == b""  # refused and closed, nothing answered
        _real_peer(lis.port)
        th.join(20)
    finally:
        lis.close()
    assert "channel" in out, out
    assert any("nested 2000 levels" in r for r in lis.refused), list(lis.refused)


def test_a_client_dripping_a_valid_hello_is_cut_at_the_deadline_and_blocks_no_one() -> None:
    lis = Listener("127.0.0.1", 0, Identity("c", 0, 2), SECRET, preauth_deadline_s=2.0)
    out: dict = {}
    th = _accept_in_thread(lis, out)
    hello = _hello(
        json.dumps({"claims": Identity("c", 1, 2).to_json(), "nonce": "0" * 64}).encode()
    )
    cut: dict = {}

    def drip() -> None:  # one byte a second: well inside the 5 s no-progress timeout
        with socket.create_connection(("127.0.0.1", lis.port), timeout=10) as s:
            t0 = time.monotonic()
            try:
                for b in hello:
                    s.sendall(bytes([b]))
                    time.sleep(1.0)
            except OSError:
                pass
            cut["after_s"] = time.monotonic() - t0

    dripper = threading.Thread(target=drip, daemon=True)
    try:
        dripper.start()
        time.sleep(0.3)  # the drip connection is accepted and authenticating
        assert _real_peer(lis.port) < 2.0  # not queued behind the drip
        th.join(20)
        dripper.join(10)
    finally:
        lis.close()
    assert "channel" in out, out
    assert 1.5 < cut["after_s"] < 5.0, cut  # the total deadline, not the no-progress timeout
    assert any("deadline" in r for r in lis.refused), list(lis.refused)


def test_a_flood_of_idle_connections_is_capped_and_the_real_peer_joins_at_once() -> None:
    lis = Listener(
        "127.0.0.1", 0, Identity("c", 0, 2), SECRET, preauth_deadline_s=20.0, max_pending_per_host=4
    )
    out: dict = {}
    me = psutil.Process()
    th = _accept_in_thread(lis, out)
    flood: list[socket.socket] = []
    try:
        rss0, threads0 = me.memory_info().rss, me.num_threads()
        for _ in range(200):  # from another loopback address than the real peer's
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", lis.port))
            s.sendall(b"TN")  # a started header, then silence
            flood.append(s)
        deadline = time.monotonic() + 5
        while lis.pending < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lis.pending == 4  # the cap per host, whatever the flood
        assert me.num_threads() - threads0 <= 4 + 1
        assert _real_peer(lis.port) < 2.0
        th.join(20)
        assert me.memory_info().rss - rss0 < 10 << 20
    finally:
        for s in flood:
            s.close()
        lis.close()
    assert "channel" in out, out
    assert any("too many connections authenticating" in r for r in lis.refused)
    assert len(lis.refused) <= 64  # the record of refusals is bounded too
