"""Stage links over real loopback sockets: the same bytes as the in-process transport, authenticated,
bounded, and failing fast when the peer dies or stalls."""

import threading
import time

import pytest
import torch

from tandem.engine.pp import frames as pp
from tandem.engine.pp.frames import LocalStageTransport, StageLinkError, StageMessage
from tandem.engine.pp.links import LinkTerms, StageListener, dial, grid_ranks

TERMS = LinkTerms(
    "test-cluster", world_size=2, secret=b"s3cret", handshake_timeout=10, op_timeout=10
)


def open_pair(terms=TERMS, dial_terms=None):
    listener = StageListener(terms, rank=1)
    box = {}

    def accept():
        try:
            box["rx"] = listener.accept(from_rank=0, name="test link")
        except Exception as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=accept)
    t.start()
    try:
        tx = dial(dial_terms or terms, 0, f"127.0.0.1:{listener.port}", 1, "test link")
    finally:
        t.join(15)
        listener.close()
    if "err" in box:
        raise box["err"]
    return tx, box["rx"]


def frames():
    g = torch.Generator().manual_seed(3)
    out = []
    for dtype, wire in [
        (torch.float32, "float32"),
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
    ]:
        h = torch.randn(2, 5, 64, generator=g).to(dtype)
        out.append(pp.encode(StageMessage(pp.KIND_FORWARD, 1, (4, 9), (0, 3), (5, 2), h), wire))
    big = torch.randn(3, 300, 256, generator=g)  # ~900 KB: larger than the socket buffers
    out.append(
        pp.encode(StageMessage(pp.KIND_FORWARD, 2, (1, 2, 3), (0, 0, 0), (300, 300, 300), big))
    )
    out.append(pp.encode(StageMessage(pp.KIND_RELEASE, 0, (4,), (0,), (0,))))
    out.append(pp.encode(StageMessage(pp.KIND_STOP)))
    return out


def test_tcp_and_in_process_links_deliver_byte_identical_frames():
    tx, rx = open_pair()
    la, lb = LocalStageTransport.pair()
    try:
        sent = frames()
        for f in sent:
            tx.send(f)
            la.send(f)
        got_tcp = [rx.recv(10) for _ in sent]
        got_local = [lb.recv(10) for _ in sent]
        assert got_tcp == got_local == sent
        a, b = pp.decode(got_tcp[3]), pp.decode(got_local[3])
        assert torch.equal(a.hidden, b.hidden)
        assert tx.bytes_sent == la.bytes_sent == rx.bytes_received
    finally:
        tx.close()
        rx.close()


SHORT = LinkTerms("test-cluster", 2, secret=b"s3cret", handshake_timeout=2, op_timeout=2)


def test_a_wrong_secret_is_refused_at_the_handshake():
    bad = LinkTerms("test-cluster", 2, secret=b"other", handshake_timeout=2, op_timeout=2)
    with pytest.raises(StageLinkError):
        open_pair(SHORT, bad)


def test_a_different_wire_dtype_is_refused_at_the_handshake():
    bad = LinkTerms("test-cluster", 2, wire_dtype="bfloat16", secret=b"s3cret", handshake_timeout=2)
    with pytest.raises(StageLinkError, match="wire dtype"):
        open_pair(SHORT, bad)


def test_recv_from_a_closed_peer_fails_at_once_and_a_silent_peer_times_out():
    tx, rx = open_pair()
    t0 = time.monotonic()
    with pytest.raises(StageLinkError, match="no progress"):
        rx.recv(0.3)
    assert time.monotonic() - t0 < 3
    tx.close()
    with pytest.raises(StageLinkError, match="closed"):
        rx.recv(10)
    rx.close()


def test_grid_ranks_number_stages_then_tp_ranks():
    assert grid_ranks((2, 1)) == [[0, 1], [2]]
    assert grid_ranks((2, 2)) == [[0, 1], [2, 3]]
