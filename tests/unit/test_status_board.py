"""The head's status board against hostile and mistaken clients: a drip client never delays the
others and is cut at the exchange deadline; a flood is capped. Real loopback sockets."""

from __future__ import annotations

import secrets
import select
import socket
import threading
import time

import psutil
import pytest

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


class _Holder(threading.Thread):
    """Keeps `n` idle connections to the board open from `source`, re-opening at once each one
    the board closes (the hostile pass's holder: `cluster status` failed 7 of 8 times)."""

    def __init__(self, port: int, n: int, source: str = "127.0.0.1") -> None:
        super().__init__(daemon=True)
        self.port, self.n, self.source = port, n, source
        self.halt, self.reopened = threading.Event(), 0
        self.socks: list[socket.socket] = []

    def _open(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), 5, (self.source, 0))

    def run(self) -> None:
        self.socks = [self._open() for _ in range(self.n)]
        while not self.halt.is_set():
            ready, _, _ = select.select(self.socks, [], [], 0.02)
            for s in ready:
                try:
                    if s.recv(4096):
                        continue  # the nonce: stay silent
                except OSError:
                    pass
                s.close()
                self.socks[self.socks.index(s)] = self._open()
                self.reopened += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        for s in self.socks:
            s.close()


def test_idle_connections_held_open_and_reopened_at_once_do_not_keep_queries_out():
    board, secret = _board()
    holder = _Holder(board.port, 2 * status.MAX_PENDING)
    try:
        holder.start()
        time.sleep(0.5)
        for _ in range(8):
            t0 = time.monotonic()
            assert query("127.0.0.1", board.port, secret, timeout_s=2)["world_size"] == 2
            assert time.monotonic() - t0 < 1.0
        assert holder.reopened > 0  # the board did cut the holder's connections
    finally:
        holder.stop()
        board.close()


def test_a_flood_from_one_address_is_capped_there_and_others_are_answered_at_once():
    board, secret = _board()
    holder = _Holder(board.port, 100, source="127.0.0.2")  # any 127/8 source reaches 127.0.0.1
    try:
        holder.start()
        time.sleep(0.5)
        with board._lock:
            theirs = [p for p in board._pending.values() if p[0] == "127.0.0.2"]
        assert len(theirs) <= status.MAX_PER_SOURCE
        t0 = time.monotonic()
        assert query("127.0.0.1", board.port, secret, timeout_s=2)["world_size"] == 2
        assert time.monotonic() - t0 < 0.5
    finally:
        holder.stop()
        board.close()


def test_a_second_join_for_a_live_rank_is_refused_and_its_row_kept():
    board, secret = _board()
    head = ("127.0.0.1", board.port, secret)
    try:
        first = status.announce(*head, 1, host="10.0.0.2", pid=111, device="cuda:0")
        with pytest.raises(status.RankOccupied, match=r"rank 1 is already joined from 10\.0\.0\.2"):
            status.announce(*head, 1, host="10.0.0.3", pid=222, device="cpu")
        row = query(*head)["ranks"][0]
        assert (row["host"], row["pid"], row["device"], row["alive"]) == (
            "10.0.0.2",
            111,
            "cuda:0",
            True,
        )
        assert (
            status.announce(*head, 1, instance=first, host="10.0.0.2", pid=112) == first
        )  # itself
        board.update(0, host="head")  # the head's own row: never taken
        with pytest.raises(status.RankOccupied):
            status.announce(*head, 0, host="10.0.0.9")
    finally:
        board.close()


def test_a_rank_whose_holder_went_silent_may_be_joined_again():
    secret = secrets.token_hex(32)
    board = StatusBoard(secret, world_size=2, stale_s=1.0).start()
    head = ("127.0.0.1", board.port, secret)
    try:
        first = status.announce(*head, 1, host="a")
        stop = threading.Event()
        status.keep_alive(*head, 1, first, stop, every_s=0.2)
        time.sleep(1.5)  # past the stale bound, but the holder keeps beating
        with pytest.raises(status.RankOccupied):
            status.announce(*head, 1, host="b")
        stop.set()
        time.sleep(1.5)  # now silent past the bound: gone
        assert query(*head)["ranks"][0]["alive"] is False
        second = status.announce(*head, 1, host="b")
        row = query(*head)["ranks"][0]
        assert row["host"] == "b" and row["instance"] == second and row["alive"]
    finally:
        board.close()
