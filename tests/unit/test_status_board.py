"""The head's status board against hostile and mistaken clients: a drip client never delays the
others and is cut at the exchange deadline; a flood is capped. Real loopback sockets."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import psutil

from tandem.cluster import status
from tandem.cluster.status import StatusBoard, query


def _board(world: int = 2) -> tuple[StatusBoard, str]:
    secret = secrets.token_hex(32)
    return StatusBoard(secret, world_size=world).start(), secret


def test_a_client_dripping_a_byte_every_second_neither_blocks_a_query_nor_outlives_the_deadline():
    board, secret = _board()
    cut: dict = {}

    def drip() -> None:
        with socket.create_connection(("127.0.0.1", board.port), timeout=10) as s:
            s.recv(status.NONCE_LEN)
            t0 = time.monotonic()
            try:
                for b in (300).to_bytes(4, "big") + b"\0" * 300:  # a plausible length, then body
                    s.sendall(bytes([b]))
                    time.sleep(1.0)
            except OSError:
                pass
            cut["after_s"] = time.monotonic() - t0

    th = threading.Thread(target=drip, daemon=True)
    try:
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        snap = query("127.0.0.1", board.port, secret, timeout_s=3)
        assert time.monotonic() - t0 < 1.0 and snap["world_size"] == 2
        th.join(15)
    finally:
        board.close()
    assert status.EXCHANGE_DEADLINE_S - 1 < cut["after_s"] < status.EXCHANGE_DEADLINE_S + 3, cut


def test_a_flood_of_silent_connections_is_capped_and_queries_still_answer():
    board, secret = _board()
    me = psutil.Process()
    threads0 = me.num_threads()
    flood = []
    try:
        for _ in range(100):
            flood.append(socket.create_connection(("127.0.0.1", board.port), timeout=5))
        time.sleep(0.5)
        assert me.num_threads() - threads0 <= status.MAX_PENDING
        for s in flood[:20]:  # free a few slots; the rest stay silent
            s.close()
        time.sleep(0.3)
        deadline = time.monotonic() + status.EXCHANGE_DEADLINE_S + 3
        while True:  # answered as soon as a slot frees, at the latest after the deadline
            try:
                assert query("127.0.0.1", board.port, secret, timeout_s=2)["world_size"] == 2
                break
            except status.StatusError:
                assert time.monotonic() < deadline
    finally:
        for s in flood:
            s.close()
        board.close()
