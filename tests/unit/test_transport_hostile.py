"""Hostile and mismatched peers are refused cleanly, nothing big is allocated, and the listener
keeps serving its real peers. Real sockets on loopback; the listening side runs in a thread."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch

from tandem.comm import base
from tandem.comm.ring import RingCommunicator, same_host_cap
from tandem.transport import shm as same_host
from tandem.transport.channel import Channel
from tandem.transport.endpoints import ConnectTimeoutError, InsecurePeerError, Listener, connect
from tandem.transport.handshake import AuthError, ClaimMismatchError, Identity
from tandem.wire import dtypes
from tandem.wire import frame as fr

SECRET = b"right-secret"


def _serve(listener: Listener, expect: set[int], out: dict, **kw: Any) -> threading.Thread:
    def body() -> None:
        try:
            out["channel"] = listener.accept(
                expect, timeout=kw.get("timeout", 20), op_timeout=5, max_frame_bytes=1 << 20
            )
        except Exception as e:
            out["error"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th


def _raw(port: int, data: bytes) -> bytes:
    """Send `data`, then read until the listener closes (it may reset us: unread bytes)."""
    chunks: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
    return b"".join(chunks)


def test_listener_refuses_hostile_clients_then_serves_its_real_peer() -> None:
    me, peer = Identity("c", 0, 2), Identity("c", 1, 2)
    lis = Listener("127.0.0.1", 0, me, SECRET)
    out: dict = {}
    tracemalloc.start()
    th = _serve(lis, {1}, out)
    try:
        # random bytes
        assert _raw(lis.port, os.urandom(4096)) == b""
        # a HELLO frame claiming a 100 GB payload
        head = fr.FIXED.pack(
            fr.MAGIC, 1, fr.HELLO, fr.HANDSHAKE, dtypes.UINT8.code, 1, 0, 0, 0, 0, 100 << 30
        )
        assert _raw(lis.port, head + struct.pack("<Q", 100 << 30)) == b""
        # another protocol version: answered in ours, so the client can name both versions
        reply = _raw(
            lis.port, fr.encode_header(fr.HELLO, fr.HANDSHAKE, 6, 0, 0, (2,), version=2) + b"{}"
        )
        assert fr.decode_fixed(reply[: fr.FIXED_SIZE])[0].version == fr.PROTOCOL_VERSION
        # the wrong secret
        with pytest.raises(AuthError, match="secret"):
            connect(
                "127.0.0.1", lis.port, peer, b"wrong-secret", expect_rank=0, handshake_timeout=10
            )
        # the right secret but another model
        with pytest.raises(
            ClaimMismatchError,
            match="model fingerprint mismatch.*'m2'.*''|model fingerprint mismatch",
        ):
            connect(
                "127.0.0.1",
                lis.port,
                Identity("c", 1, 2, model_fingerprint="m2"),
                SECRET,
                expect_rank=0,
                handshake_timeout=10,
            )
        # the real peer
        ch = connect("127.0.0.1", lis.port, peer, SECRET, expect_rank=0, handshake_timeout=10)
        th.join(20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        lis.close()
    assert "channel" in out, out
    assert peak < 4 << 20, f"peak traced allocation {peak} bytes"
    # Each stranger is refused on its own handshake thread: the client may see its refusal
    # (and the real peer be served) before the listener's thread has recorded why.
    words = ("BadMagicError", "FrameTooLargeError", "AuthError", "ClaimMismatchError")
    deadline = time.monotonic() + 10
    while not all(w in (reasons := " | ".join(lis.refused)) for w in words):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for word in words:
        assert word in reasons, reasons
    assert "peer speaks version 2, this rank speaks version 1" in reasons
    x = np.arange(6, dtype="<f4")
    ch.send_array(op=fr.P2P, seq=1, dtype_code=1, shape=(2, 3), payload=x)
    header, payload = out["channel"].recv_array(op=fr.P2P, seq=1)
    assert header.shape == (2, 3) and np.frombuffer(payload, "<f4").tolist() == x.tolist()


def test_mismatched_claims_are_refused_naming_both_sides() -> None:
    cases = [
        (Identity("c", 1, 2, wire_dtype="bfloat16"), "wire dtype mismatch.*'bfloat16'.*'float32'"),
        (Identity("other", 1, 2), "cluster id mismatch.*'other'.*'c'"),
        (Identity("c", 1, 3), "world size mismatch.*3.*2"),
        (Identity("c", 0, 2), "rank mismatch"),
    ]
    for ident, pattern in cases:
        lis = Listener("127.0.0.1", 0, Identity("c", 0, 2), SECRET)
        out: dict = {}
        th = _serve(lis, {1}, out, timeout=1.5)
        with pytest.raises(ClaimMismatchError, match=pattern):
            connect("127.0.0.1", lis.port, ident, SECRET, expect_rank=0, handshake_timeout=5)
        th.join(10)
        lis.close()
        assert isinstance(out.get("error"), ConnectTimeoutError)


def test_without_a_secret_only_loopback_peers_are_dialed() -> None:
    with pytest.raises(InsecurePeerError, match="secret"):
        connect("10.255.255.1", 9, Identity("c", 1, 2), None, handshake_timeout=1)


def _pair(max_frame_bytes: int = 1 << 20) -> tuple[Channel, Channel]:
    lis = Listener("127.0.0.1", 0, Identity("c", 0, 2, role="stage"), SECRET)
    out: dict = {}
    th = _serve(lis, {1}, out)
    ch = connect(
        "127.0.0.1",
        lis.port,
        Identity("c", 1, 2, role="stage"),
        SECRET,
        expect_rank=0,
        handshake_timeout=10,
    )
    th.join(20)
    lis.close()
    out["channel"].max_frame_bytes = max_frame_bytes
    return out["channel"], ch


def test_authenticated_frame_claiming_100_gb_is_refused_before_allocation() -> None:
    rx, tx = _pair()
    tracemalloc.start()
    try:
        tx.ts.send_all([fr.encode_header(fr.DATA, fr.P2P, dtypes.FLOAT32.code, 1, 0, (25 << 30,))])
        with pytest.raises(fr.FrameTooLargeError, match="107374182400"):
            rx.recv_array(op=fr.P2P, seq=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_p2p_frame_of_another_op_or_seq_is_refused_before_its_payload() -> None:
    rx, tx = _pair()
    tx.send_array(op=fr.P2P, seq=5, dtype_code=1, shape=(4,), payload=np.zeros(4, "<f4"))
    with pytest.raises(Exception, match="expected a DATA frame of p2p #4"):
        rx.recv_array(op=fr.P2P, seq=4)


def _fake_ring_pair(small: int = 1 << 16) -> tuple[RingCommunicator, Channel, Channel]:
    """Rank 0 as a real RingCommunicator; rank 1 played by the test through raw channels."""
    lis0 = Listener("127.0.0.1", 0, Identity("c", 0, 2), SECRET)
    lis1 = Listener("127.0.0.1", 0, Identity("c", 1, 2), SECRET)
    got: dict = {}
    th = _serve(lis1, {0}, got)

    def form() -> None:
        got["ring"] = RingCommunicator.create(
            0,
            2,
            right=("127.0.0.1", lis1.port),
            listener=lis0,
            secret=SECRET,
            cluster_id="c",
            op_timeout=5,
            max_frame_bytes=1 << 20,
            small_max_bytes=small,
            heartbeat_timeout=0,  # the raw channels play rank 1's data link only
        )

    former = threading.Thread(target=form, daemon=True)
    former.start()
    to_rank0 = connect(
        "127.0.0.1", lis0.port, Identity("c", 1, 2), SECRET, expect_rank=0, handshake_timeout=10
    )
    th.join(20)
    # rank 1's part of ring formation at N = 2: answer rank 0's same-host offer with "no"
    same_host.negotiate(1, to_rank0, got["channel"], same_host_cap(small), enabled=False)
    former.join(20)
    lis1.close()
    return got["ring"], to_rank0, got["channel"]


def test_ring_refuses_a_frame_claiming_100_gb_mid_collective() -> None:
    ring, to_rank0, _ = _fake_ring_pair()
    tracemalloc.start()
    try:
        fp = fr.fingerprint(fr.ALL_GATHER, dtypes.FLOAT32.code, (0, 0))
        to_rank0.ts.send_all(
            [
                fr.encode_header(fr.DATA, fr.ALL_GATHER, 1, 1, fp, (25 << 30,))[: fr.FIXED_SIZE],
                struct.pack("<Q", 25 << 30),
            ]
        )
        with pytest.raises(fr.FrameError):
            ring.all_gather(torch.zeros(3), 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(base.CommClosedError, match="unusable"):
        ring.all_reduce_sum(torch.zeros(3))


def test_ring_detects_op_desync_by_fingerprint_before_reading_payload() -> None:
    ring, to_rank0, _ = _fake_ring_pair()
    fp = fr.fingerprint(
        fr.ALL_REDUCE, 1, (5,)
    )  # the peer all-reduces shape (5,), rank 0 shape (4,)
    to_rank0.send_array(
        op=fr.ALL_REDUCE,
        seq=1,
        dtype_code=1,
        shape=(5,),
        payload=np.zeros(5, "<f4"),
        fingerprint=fp,
    )
    with pytest.raises(base.OpDesyncError, match="another shape"):
        ring.all_reduce_sum(torch.zeros(4))


def test_ring_formation_fails_at_once_when_its_dial_is_refused() -> None:
    lis0 = Listener("127.0.0.1", 0, Identity("c", 0, 2), SECRET)
    lis1 = Listener("127.0.0.1", 0, Identity("c", 1, 2), b"another-clusters-secret")
    out: dict = {}
    th = _serve(lis1, {0}, out, timeout=10)
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="secret"):
        RingCommunicator.create(
            0,
            2,
            right=("127.0.0.1", lis1.port),
            listener=lis0,
            secret=SECRET,
            cluster_id="c",
            handshake_timeout=60,
        )
    assert time.monotonic() - t0 < 10, "waited for the handshake timeout instead of failing"
    th.join(15)
    lis1.close()
