"""The cluster's status board: who has joined, on what device and dtype, holding which part, and
how far away. A tiny authenticated JSON exchange (no pickle), served by the head on the token's
status port.

One exchange per TCP connection, each on its own thread under a total deadline (EXCHANGE_DEADLINE_S,
however slowly the client drips), at most MAX_PENDING at once and MAX_PER_SOURCE from one address.
A connection past either cap does not wait for a slot: it takes the slot of the oldest connection
that has not yet delivered its request (from its own address when that address is at its cap,
else from the address holding the most), which is closed. A real client sends its request one
round trip after connecting, so idle or dripping connections, however many and however often
re-opened, are what gets closed, and `query` tries again if it was cut all the same. So one slow
or hostile client never keeps the board from answering the others:

    board  -> client   16-byte random nonce
    client -> board    u32 length | 32-byte HMAC-SHA256(secret, nonce | body) | body (UTF-8 JSON)
    board  -> client   u32 length | 32-byte HMAC-SHA256(secret, nonce | reply) | reply (JSON)
                       (or u32 0 alone: the request's MAC did not verify)

A body is {"kind": "announce", "rank": r, "instance": i, ...facts}, {"kind": "alive", "rank": r,
"instance": i}, {"kind": "query"} or {"kind": "ping"}. A wrong MAC, an oversized length or
malformed JSON closes the connection; the board keeps serving.

A rank has one holder: the `instance` (a random id per joining process) that announced it. While
that holder keeps sending "alive" (every ALIVE_EVERY_S), another announce for the rank is refused
(RankOccupied, naming the holder) instead of overwriting its row; a holder silent for STALE_S is
gone, and the rank may be taken again. Rows the head records itself are never taken.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import statistics
import struct
import threading
import time
from typing import Any

from tandem import boundedjson

MAX_MESSAGE = 64 * 1024
MAX_DEPTH = 8  # a snapshot is {"ranks": [{facts}]}: three levels
EXCHANGE_DEADLINE_S = 5.0
MAX_PENDING = 16
MAX_PER_SOURCE = 4
QUERY_ATTEMPTS = 3
ALIVE_EVERY_S = 5.0
STALE_S = 3 * ALIVE_EVERY_S
REFUSED = 0  # a zero length in reply: the board could not authenticate the request
NONCE_LEN = 16
MAC_LEN = 32
_LEN = struct.Struct(">I")


class StatusError(RuntimeError):
    """The status exchange failed (unreachable board, wrong secret, bad reply)."""


class BoardUnreachable(StatusError):
    """Nothing answers on the head's status port."""


class StatusAuthError(StatusError):
    """The other side does not hold this cluster's secret."""


class BoardCut(StatusError):
    """The connection was closed or reset mid-exchange (the board gave its slot to another)."""


class BoardRefusal(StatusError):
    """The board answered, and said no (an unknown rank, a rank held by another node, ...)."""


class RankOccupied(BoardRefusal):
    """The rank is held by another live node (a second `cluster join` for the same rank)."""


def _mac(secret: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(secret, nonce + body, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """n bytes, or StatusError once `deadline` (monotonic) passes, however they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StatusError("the status exchange ran past its deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise BoardCut("the peer closed the connection mid-message")
        buf += chunk
    return bytes(buf)


def _send_msg(sock: socket.socket, secret: bytes, nonce: bytes, obj: dict[str, Any]) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise StatusError(f"status message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    sock.sendall(_LEN.pack(len(body)) + _mac(secret, nonce, body) + body)


def _recv_msg(sock: socket.socket, secret: bytes, nonce: bytes, deadline: float) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n == REFUSED:
        raise StatusAuthError(
            "the status board refused this cluster secret: the token is from another cluster "
            "(or the head was re-initialized)"
        )
    if n > MAX_MESSAGE:  # checked before anything is allocated
        raise StatusError(f"status message claims {n} bytes (limit {MAX_MESSAGE})")
    mac = _recv_exact(sock, MAC_LEN, deadline)
    body = _recv_exact(sock, n, deadline)
    if not hmac.compare_digest(mac, _mac(secret, nonce, body)):
        raise StatusAuthError("status message MAC mismatch: the peer has another cluster's secret")
    try:
        obj = boundedjson.loads(body, max_bytes=MAX_MESSAGE, max_depth=MAX_DEPTH)
    except boundedjson.BoundedJSONError as e:
        raise StatusError(f"status message: {e}") from None
    if not isinstance(obj, dict):
        raise StatusError("status message is not a JSON object")
    return obj


class StatusBoard:
    """Runs on the head: a thread answering announces, pings and queries on (host, port)."""

    def __init__(
        self,
        secret: str,
        host: str = "127.0.0.1",
        port: int = 0,
        world_size: int = 1,
        stale_s: float = STALE_S,
    ):
        self.secret = bytes.fromhex(secret)
        self.world_size = world_size
        self.stale_s = stale_s
        self.ranks: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        # open exchanges: connection -> [source address, accepted at, request delivered]
        self._pending: dict[socket.socket, list] = {}
        self._thread = threading.Thread(target=self._serve, name="tandem-status", daemon=True)

    def start(self) -> StatusBoard:
        self._thread.start()
        return self

    def update(self, rank: int, /, **facts: Any) -> None:
        """Adds facts about `rank` (the head records its own, and layer/shard figures)."""
        with self._lock:
            self.ranks.setdefault(rank, {"rank": rank}).update(facts)

    def snapshot(self) -> dict[str, Any]:
        """Every row; an announced rank also says whether its holder is still `alive`."""
        with self._lock:
            ranks = [dict(v) for _, v in sorted(self.ranks.items())]
        now = time.monotonic()
        for row in ranks:
            seen = row.pop("_seen", None)
            if "instance" in row:
                row["alive"] = seen is not None and now - seen < self.stale_s
        return {"world_size": self.world_size, "ranks": ranks, "time": time.time()}

    def claim(self, rank: int, instance: str, facts: dict[str, Any]) -> str | None:
        """Records `rank` for `instance` unless another live holder has it; why not, or None."""
        now = time.monotonic()
        with self._lock:
            row = self.ranks.get(rank)
            if row is not None and row.get("instance") != instance:
                held = "instance" not in row or now - row.get("_seen", 0.0) < self.stale_s
                if held:
                    who = f"{row.get('host', row.get('peer', '?'))} (pid {row.get('pid', '?')})"
                    return (
                        f"rank {rank} is already joined from {who}; stop that node first, or "
                        f"join as another rank (a silent holder is dropped after {self.stale_s:g} s)"
                    )
            self.ranks[rank] = {"rank": rank, **facts, "instance": instance, "_seen": now}
        return None

    def alive(self, rank: int, instance: str) -> bool:
        """Refreshes `rank`'s holder; False if `instance` does not hold it."""
        with self._lock:
            row = self.ranks.get(rank)
            if row is None or row.get("instance") != instance:
                return False
            row["_seen"] = time.monotonic()
            return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            if not self._admit(conn, addr[0]):
                conn.close()  # every open exchange has its request in: they end soon
                continue
            threading.Thread(
                target=self._exchange, args=(conn, addr[0]), name="tandem-status-x", daemon=True
            ).start()

    def _admit(self, conn: socket.socket, source: str) -> bool:
        """Registers `conn`, closing the exchange whose slot it takes when a cap is reached
        (module docstring); False when no slot can be taken."""
        with self._lock:
            mine = [c for c, p in self._pending.items() if p[0] == source]
            victims = None
            if len(mine) >= MAX_PER_SOURCE:
                victims = mine
            elif len(self._pending) >= MAX_PENDING:
                counts: dict[str, int] = {}
                for p in self._pending.values():
                    counts[p[0]] = counts.get(p[0], 0) + 1
                most = max(counts, key=lambda a: counts[a])
                victims = [c for c, p in self._pending.items() if p[0] == most]
            if victims is not None:
                idle = [c for c in victims if not self._pending[c][2]]
                if not idle:
                    return False
                oldest = min(idle, key=lambda c: self._pending[c][1])
                del self._pending[oldest]  # its thread ends at the shutdown below
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._pending[conn] = [source, time.monotonic(), False]
        return True

    def _delivered(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._pending:
                self._pending[conn][2] = True

    def _exchange(self, conn: socket.socket, peer: str) -> None:
        try:
            with conn, contextlib.suppress(Exception):  # whatever a client sends, the board lives
                self._answer(conn, peer, time.monotonic() + EXCHANGE_DEADLINE_S)
        finally:
            with self._lock:
                self._pending.pop(conn, None)

    def _answer(self, conn: socket.socket, peer: str, deadline: float) -> None:
        conn.settimeout(EXCHANGE_DEADLINE_S)
        nonce = os.urandom(NONCE_LEN)
        conn.sendall(nonce)
        try:
            msg = _recv_msg(conn, self.secret, nonce, deadline)
        except StatusAuthError:
            conn.sendall(_LEN.pack(REFUSED))
            raise
        self._delivered(conn)
        kind, rank, instance = msg.get("kind"), msg.get("rank"), msg.get("instance")
        if kind in ("announce", "alive"):
            if type(rank) is not int or not 0 <= rank < self.world_size:
                _send_msg(conn, self.secret, nonce, {"ok": False, "error": f"no rank {rank!r}"})
                return
            if not isinstance(instance, str) or not 0 < len(instance) <= 64:
                _send_msg(conn, self.secret, nonce, {"ok": False, "error": "no instance id"})
                return
        if kind == "announce":
            facts = {k: v for k, v in msg.items() if k not in ("kind", "rank", "instance", "_seen")}
            why = self.claim(rank, instance, {**facts, "peer": peer, "joined_at": time.time()})
            reply = {"ok": False, "code": "rank_occupied", "error": why} if why else {"ok": True}
            _send_msg(conn, self.secret, nonce, reply)
        elif kind == "alive":
            held = self.alive(rank, instance)
            reply = (
                {"ok": True} if held else {"ok": False, "error": f"not the holder of rank {rank}"}
            )
            _send_msg(conn, self.secret, nonce, reply)
        elif kind == "query":
            _send_msg(conn, self.secret, nonce, {"ok": True, **self.snapshot()})
        elif kind == "ping":
            _send_msg(conn, self.secret, nonce, {"ok": True})
        else:
            _send_msg(conn, self.secret, nonce, {"ok": False, "error": f"unknown kind {kind!r}"})


def exchange(
    host: str, port: int, secret: str, msg: dict[str, Any], timeout_s: float = 5.0
) -> dict:
    """One authenticated request/reply with the board at host:port."""
    key = bytes.fromhex(secret)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise BoardUnreachable(
            f"cannot reach the head's status board at {host}:{port} ({e.strerror or e}): "
            "is the head up, and is that port open between the nodes?"
        ) from e
    deadline = time.monotonic() + timeout_s
    with sock:
        sock.settimeout(timeout_s)
        try:
            nonce = _recv_exact(sock, NONCE_LEN, deadline)
            _send_msg(sock, key, nonce, msg)
            reply = _recv_msg(sock, key, nonce, deadline)
        except StatusError:
            raise
        except TimeoutError as e:
            raise StatusError(f"status exchange with {host}:{port} timed out: {e}") from e
        except OSError as e:  # reset: cut as the board gave its slot away
            raise BoardCut(f"status exchange with {host}:{port} failed: {e}") from e
    if not reply.get("ok"):
        err = RankOccupied if reply.get("code") == "rank_occupied" else BoardRefusal
        raise err(f"the status board refused: {reply.get('error')}")
    return reply


def measure_rtt_ms(host: str, port: int, secret: str, n: int = 5) -> float:
    """Median round trip of an authenticated ping (connect included), in milliseconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        exchange(host, port, secret, {"kind": "ping"})
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def new_instance() -> str:
    """A fresh holder id for one joining process."""
    return os.urandom(8).hex()


def announce(
    host: str, port: int, secret: str, rank: int, /, instance: str | None = None, **facts: Any
) -> str:
    """Claims `rank` on the board; RankOccupied if another live node holds it. Returns the
    instance id to keep it with (`keep_alive`)."""
    instance = instance or new_instance()
    exchange(host, port, secret, {"kind": "announce", "rank": rank, "instance": instance, **facts})
    return instance


def keep_alive(
    host: str,
    port: int,
    secret: str,
    rank: int,
    instance: str,
    stop: threading.Event,
    every_s: float = ALIVE_EVERY_S,
) -> threading.Thread:
    """A daemon thread telling the board every `every_s` that `instance` still holds `rank`,
    until `stop` is set (a missed beat is retried at the next; the head may be down)."""

    def beat() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(StatusError):
                exchange(host, port, secret, {"kind": "alive", "rank": rank, "instance": instance})

    th = threading.Thread(target=beat, name="tandem-status-alive", daemon=True)
    th.start()
    return th


def query(host: str, port: int, secret: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The board's snapshot; a connection the board cut (`BoardCut`: its slot taken under a
    flood) is tried again, up to QUERY_ATTEMPTS times; any other error is raised at once."""
    attempt = 1
    while True:
        try:
            return exchange(host, port, secret, {"kind": "query"}, timeout_s)
        except BoardCut:
            if attempt >= QUERY_ATTEMPTS:
                raise
            attempt += 1
