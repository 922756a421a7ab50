"""Spin-then-block receives: the same bytes with or without the spin, the same timeouts, and a
clear error for a bad TANDEM_SPIN_US. Real TCP sockets on loopback."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from tandem.transport.socketio import (
    DEFAULT_SPIN_US,
    SPIN_ENV,
    Duplex,
    PeerTimeoutError,
    TimedSocket,
    spin_from_env,
)


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lis:
        a = socket.create_connection(lis.getsockname())
        b, _ = lis.accept()
    return a, b


def _dribble(sock: socket.socket, data: bytes, pieces: int, gap: float) -> threading.Thread:
    """Send `data` in `pieces` chunks `gap` seconds apart (so receives both spin and block)."""

    def body() -> None:
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            time.sleep(gap)
            sock.sendall(data[i : i + step])

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("spin", [0.0, 0.0005, 0.05])
def test_received_bytes_are_identical_with_and_without_spin(spin: float) -> None:
    data = os.urandom(300_000)
    a, b = _pair()
    try:
        ts = TimedSocket(b, "peer", timeout=10, spin=spin)
        th = _dribble(a, data, pieces=7, gap=0.01)
        assert bytes(ts.recv_exact(len(data))) == data
        th.join()
        out = TimedSocket(socket.socket(), "unused", timeout=10, spin=spin)
        io = Duplex(out, ts)
        buf = bytearray(len(data))
        seen: list[int] = []
        th = _dribble(a, data, pieces=5, gap=0.01)
        io.recv_into(memoryview(buf), seen.append)
        th.join()
        assert bytes(buf) == data and seen[-1] == len(data)
        io.close()
        out.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("spin", [0.0, 0.1, 5.0])
def test_stalled_peer_times_out_on_schedule_whatever_the_spin(spin: float) -> None:
    timeout = 0.4
    a, b = _pair()
    try:
        ts = TimedSocket(b, "stalled", timeout=timeout, spin=spin)
        a.sendall(b"xy")  # some progress, then silence
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="stalled"):
            ts.recv_exact(3)
        assert timeout * 0.95 <= time.monotonic() - t0 < timeout + 0.5
        io = Duplex(TimedSocket(socket.socket(), "unused", timeout=timeout, spin=spin), ts)
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="stalled"):
            io.recv_into(memoryview(bytearray(4)))
        assert timeout * 0.95 <= time.monotonic() - t0 < timeout + 0.5
        io.close()
    finally:
        a.close()
        b.close()


def test_spin_env_default_zero_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert spin_from_env() == DEFAULT_SPIN_US / 1e6
    monkeypatch.setenv(SPIN_ENV, "0")
    assert spin_from_env() == 0.0
    monkeypatch.setenv(SPIN_ENV, "750")
    assert spin_from_env() == 0.00075
    for bad in ("fast", "-5", "1.5"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ValueError, match=SPIN_ENV):
            spin_from_env()


def test_small_path_sends_in_order_through_a_full_socket_and_receives_in_pieces():
    import numpy as np

    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    out = Duplex(TimedSocket(a, "b", 10.0), TimedSocket(a, "b", 10.0))
    chunk, filler = bytes(range(256)) * 64, bytearray()
    while True:  # fill the kernel's buffers: the small send cannot go out whole, inline
        try:
            filler += chunk[: a.send(chunk)]
        except BlockingIOError:
            break
    payload = np.arange(1024, dtype=np.float32)
    out.send_small(b"HEAD", payload)  # what the kernel refuses goes to the sender thread
    filler2 = bytes(range(256)) * 4096
    out.send((filler2,))  # queued behind it, never around it
    out.send_small(b"TAIL", payload)  # the queue is busy: goes behind as well
    got = bytearray()
    b.settimeout(10)
    want = bytes(filler) + b"HEAD" + payload.tobytes() + filler2 + b"TAIL" + payload.tobytes()
    while len(got) < len(want):
        got += b.recv(1 << 20)
    out.flush()
    assert bytes(got) == want

    inp = Duplex(TimedSocket(b, "a", 10.0), TimedSocket(b, "a", 10.0))
    frame = bytes(range(200)) * 21
    seen: list[int] = []
    th = _dribble(a, frame, pieces=3, gap=0.05)
    buf = bytearray(len(frame))
    inp.recv_small(memoryview(buf), seen.append)
    th.join()
    assert bytes(buf) == frame
    assert seen == sorted(seen) and seen[-1] == len(frame) and len(seen) >= 2
    a.close()
    b.close()


def test_spin_yields_the_core_every_turn_so_an_oversubscribed_peer_can_run(monkeypatch):
    import tandem.transport.socketio as sio

    calls = []
    monkeypatch.setattr(sio, "_sched_yield", lambda: calls.append(1))
    a, b = _pair()
    ts = TimedSocket(b, "a", 5.0, spin=0.002)
    assert ts.spin_readable(0.002) is False  # nothing sent: spins out its budget
    assert len(calls) > 1
    a.sendall(b"x")
    time.sleep(0.05)
    calls.clear()
    assert ts.spin_readable(0.002) is True and calls == []  # readable: returns at once
    a.close()
    b.close()
