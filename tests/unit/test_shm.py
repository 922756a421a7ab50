"""The same-host pair segment (`transport.shm`): frames swap intact and in order, the segment is
proven to be the peer's and never left on disk, and waits fail closed (closed peer, a peer in
another op, the timeout)."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from tandem.transport import shm
from tandem.transport.channel import Channel
from tandem.transport.handshake import Identity
from tandem.transport.socketio import PeerClosedError, PeerTimeoutError, TimedSocket
from tandem.wire import frame as fr

pytestmark = pytest.mark.skipif(not shm.supported(), reason="same-host memory: Linux x86-64 only")

CAP = 4096


def _sockets(timeout: float = 5.0) -> tuple[TimedSocket, TimedSocket]:
    with socket.create_server(("127.0.0.1", 0)) as server:  # a real TCP pair on loopback
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return TimedSocket(a, "peer-b", timeout, spin=0.0002), TimedSocket(b, "peer-a", timeout, 0.0)


def _pair(timeout: float = 5.0) -> tuple[shm.SamePair, shm.SamePair, TimedSocket, TimedSocket]:
    ta, tb = _sockets(timeout)
    a, offer, path = shm.SamePair.create(CAP, ta)
    try:
        b = shm.SamePair.attach(offer, CAP, tb)
    finally:
        os.unlink(path)
    assert b is not None
    return a, b, ta, tb


def test_thousands_of_swaps_deliver_each_peers_frame_intact_and_in_order() -> None:
    a, b, _, _ = _pair()
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, CAP - 48, 3000)
    got: dict[str, list] = {"a": [], "b": []}

    def run(end: shm.SamePair, name: str, salt: int) -> None:
        for i, n in enumerate(sizes):
            head = f"{name}{i:07d}".encode()
            payload = np.full(int(n), (i + salt) % 251, np.uint8)
            frame = end.exchange(head, payload)
            got[name].append((bytes(frame[:8]), len(frame) - 8, int(frame[-1]) if n else None))

    t = threading.Thread(target=run, args=(b, "b", 7))
    t.start()
    run(a, "a", 3)
    t.join(30)
    for i, n in enumerate(sizes):
        last = None if n == 0 else (i + 7) % 251  # a sees b's frame i, and vice versa
        assert got["a"][i] == (f"b{i:07d}".encode(), n, last)
        assert got["b"][i] == (f"a{i:07d}".encode(), n, None if n == 0 else (i + 3) % 251)


def test_a_segment_on_another_host_or_with_another_token_is_not_attached() -> None:
    ta, tb = _sockets()
    a, offer, path = shm.SamePair.create(CAP, ta)
    try:
        forged = offer[:8] + bytes(16) + offer[24:]  # the name exists here, the token differs
        assert shm.SamePair.attach(forged, CAP, tb) is None
        missing = offer[:24] + b"tandem-1-0123456789ab"  # no such segment on this host
        assert shm.SamePair.attach(missing, CAP, tb) is None
        assert shm.SamePair.attach(offer, CAP * 2, tb) is None  # another slot size
    finally:
        os.unlink(path)
    a.close()


@pytest.mark.parametrize(
    "offer",
    [b"", b"NOTSHM01" + bytes(16) + b"tandem-1-0123456789ab", shm.MAGIC + bytes(16) + b"../etc/x"],
)
def test_malformed_offers_are_refused_with_a_typed_error(offer: bytes) -> None:
    _, tb = _sockets()
    with pytest.raises(shm.ShmError):
        shm.SamePair.attach(offer, CAP, tb)


def test_a_frame_larger_than_the_slot_is_refused() -> None:
    a, _, _, _ = _pair()
    with pytest.raises(shm.ShmError, match="exceeds"):
        a.exchange(b"h" * 48, np.zeros(CAP, np.uint8))


def test_a_peer_that_closes_its_socket_fails_the_wait_at_once() -> None:
    a, _, _, tb = _pair(timeout=30.0)
    threading.Timer(0.2, tb.sock.close).start()
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError):
        a.exchange(b"head", np.zeros(4, np.uint8))
    assert time.monotonic() - t0 < 5.0  # not the 30 s timeout


def test_a_peer_that_sends_tcp_instead_of_a_frame_is_reported_with_its_header() -> None:
    a, _, _, tb = _pair(timeout=30.0)
    header = fr.encode_header(fr.DATA, fr.ALL_GATHER, 1, 9, 0, (8,))
    tb.send_all([header])
    with pytest.raises(shm.PeerDivergedError) as info:
        a.exchange(b"head", np.zeros(4, np.uint8))
    assert info.value.peeked == header[: fr.FIXED_SIZE]


def test_a_silent_peer_times_out() -> None:
    a, _, _, _ = _pair(timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError):
        a.exchange(b"head", np.zeros(4, np.uint8))
    assert 0.5 <= time.monotonic() - t0 < 3.0


def _channels() -> tuple[Channel, Channel]:
    ta, tb = _sockets()
    return (
        Channel(ta, Identity("t", 0, 2), Identity("t", 1, 2), 1 << 20),
        Channel(tb, Identity("t", 1, 2), Identity("t", 0, 2), 1 << 20),
    )


@pytest.mark.parametrize("opt_in", [(True, True), (True, False), (False, True)])
def test_negotiation_agrees_on_both_ranks_and_leaves_no_segment_on_disk(opt_in) -> None:
    before = {n for n in os.listdir("/dev/shm") if n.startswith(f"tandem-{os.getpid()}-")}
    c0, c1 = _channels()  # one socket each way is enough: rank r sends on c_r, receives on c_r
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r1=shm.negotiate(1, c1, c1, CAP, opt_in[1])))
    t.start()
    out["r0"] = shm.negotiate(0, c0, c0, CAP, opt_in[0])
    t.join(10)
    assert (out["r0"] is not None) == (out["r1"] is not None) == all(opt_in)
    after = {n for n in os.listdir("/dev/shm") if n.startswith(f"tandem-{os.getpid()}-")}
    assert after == before


@pytest.mark.parametrize("raw,want", [("", True), ("1", True), ("0", False)])
def test_the_env_switch_parses_and_refuses_anything_else(monkeypatch, raw, want) -> None:
    monkeypatch.setenv(shm.SHM_ENV, raw)
    assert shm.enabled_from_env() is want
    monkeypatch.setenv(shm.SHM_ENV, "yes")
    with pytest.raises(ValueError, match="TANDEM_SHM"):
        shm.enabled_from_env()
