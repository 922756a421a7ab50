"""Same-host shared memory for the latency path: two ranks on one machine swap small frames
through a segment in /dev/shm instead of the loopback TCP stack.

Why: a decode step's all-reduces are tiny (4 KB) and each follows a weight stream that evicted
the comm path from the caches; traced in place on a 2-core x86 host, a loopback TCP exchange
costs ~70-90 us of which the kernel's TCP path is most, a shared-memory swap ~35-50 us. NCCL,
MPI and gloo's peers do the same: sockets between hosts, shared memory inside one.

Layout (one segment per rank pair, created by rank 0 and mapped by rank 1):

    [0:8)  MAGIC          [8:24) token (16 random bytes, also sent over the authenticated channel)
    slot(w, p) at 64 + (2 w + p) * SLOT, w = writer (0: creator, 1: attacher), p = parity:
        [0:8) seq (int64)   [8:16) frame length (int64)   [64:64+cap) the frame

`exchange(c)` (the c-th swap, counted alike on both ranks) writes this rank's frame into slot
(me, c % 2), then stores seq = c; the peer waits until slot (peer, c % 2) shows seq = c. Two
slots per writer suffice because a rank writes swap c + 2 only after it has read the peer's
swap c + 1, which the peer writes only after it has finished reading swap c.

Ordering: the payload is stored before the seq; the reader loads the seq before the payload.
x86-64 keeps stores in program order and loads in program order (TSO), and each store is a
separate call into compiled code that no compiler reorders across, so this holds there without
fences; weaker CPUs (arm64) would need explicit release/acquire fences that pure Python cannot
issue, so `supported()` is False there and such ranks stay on TCP.

Same host is proven, not guessed: rank 1 maps the segment by the name rank 0 sent and must read
back the token rank 0 wrote into it (a name that also exists on another machine holds another
token). The file is 0600 and unlinked as soon as rank 1 has answered, so a crash leaks nothing.
A wait spins (yielding the core each turn) for TANDEM_SHM_SPIN_US (default 20 ms: longer than
TCP's spin, because a shared-memory waiter has no wake-up to block on and a nap overshoots the
peer's frame by its own length; lockstep waits in decode are mostly well under 20 ms), then naps
in growing steps up to 1 ms (5 ms after a second: an idle worker waiting for the next step's
broadcast); the TCP socket is polled throughout so a peer that dies (its socket closes)
raises PeerClosedError at once, and `timeout` seconds without the peer's frame raise
PeerTimeoutError.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from tandem.transport.channel import Channel
from tandem.transport.socketio import (
    PeerClosedError,
    TimedSocket,
    TransportError,
    _sched_yield,
    spin_from_env,
)
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

SHM_ENV = "TANDEM_SHM"  # "0" keeps same-host pairs on TCP
SPIN_ENV = "TANDEM_SHM_SPIN_US"
DEFAULT_SPIN_US = 20_000
MAGIC = b"TNDMSHM1"
_SLOT_HEAD = 64
_BASE = 64
_NAME = re.compile(r"^tandem-[0-9]+-[0-9a-f]{12}$")
_DIR = "/dev/shm"
_MAX_OFFER = 24 + 64


class ShmError(TransportError):
    """A same-host segment that cannot be used (a malformed offer, a frame over the slot size)."""


class PeerDivergedError(ShmError):
    """While this rank waited for the peer's same-host frame, the peer sent TCP bytes instead: it
    called another op. `peeked`: the first bytes of what it sent (its frame header)."""

    def __init__(self, message: str, peeked: bytes) -> None:
        super().__init__(message)
        self.peeked = peeked


def enabled_from_env() -> bool:
    """TANDEM_SHM: unset or "1" on, "0" off; anything else is refused."""
    raw = os.environ.get(SHM_ENV, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"{SHM_ENV}={raw!r}: expected 1 (same-host shared memory) or 0 (TCP only)")


def supported() -> bool:
    """Linux on x86-64 with /dev/shm (see the module docstring for why x86-64 only)."""
    return (
        sys.platform.startswith("linux")
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir(_DIR)
    )


def _slot_size(cap: int) -> int:
    return _SLOT_HEAD + (cap + 63) // 64 * 64


class SamePair:
    """One rank's end of a same-host pair segment (`create` on rank 0, `attach` on rank 1)."""

    def __init__(self, mm: mmap.mmap, me: int, cap: int, inp: TimedSocket) -> None:
        self._mm, self._me, self._cap, self._inp = mm, me, cap, inp
        self.spin = spin_from_env(SPIN_ENV, DEFAULT_SPIN_US)
        self._slot = _slot_size(cap)
        self._view = memoryview(mm)
        self._words = self._view.cast("q")  # int64 words: one plain 8-byte store or load each
        # per parity, the `Lane` whose header the slot holds (None: `exchange` wrote another), so
        # a lane rewrites only the header's seq word
        self.header_of: list[object] = [None, None]
        self.count = 0  # swaps begun; swap c uses the slots of parity c & 1
        # per parity, the index in `words` of this rank's slot and of the peer's
        self._mine_word = tuple(self._word(me, p) for p in (0, 1))
        self._peer_word = tuple(self._word(1 - me, p) for p in (0, 1))

    def _off(self, w: int, p: int) -> int:
        return _BASE + (2 * w + p) * self._slot

    def _word(self, w: int, p: int) -> int:
        return self._off(w, p) // 8

    @classmethod
    def size_for(cls, cap: int) -> int:
        return _BASE + 4 * _slot_size(cap)

    @classmethod
    def create(cls, cap: int, inp: TimedSocket) -> tuple[SamePair, bytes, str]:
        """A fresh segment for frames up to `cap` bytes: (this end, the offer to send to the
        peer, the path to unlink once the peer has answered)."""
        token = os.urandom(16)
        name = f"tandem-{os.getpid()}-{token[:6].hex()}"
        path = os.path.join(_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, cls.size_for(cap))
            mm = mmap.mmap(fd, cls.size_for(cap))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm[0:8], mm[8:24] = MAGIC, token
        return cls(mm, 0, cap, inp), MAGIC + token + name.encode(), path

    @classmethod
    def attach(cls, offer: bytes, cap: int, inp: TimedSocket) -> SamePair | None:
        """Rank 1's end, or None when the offer's segment is not on this host (or not ours)."""
        if len(offer) < 24 or offer[:8] != MAGIC:
            raise ShmError(f"{inp.peer}: malformed same-host offer ({len(offer)} bytes)")
        token, name = offer[8:24], offer[24:].decode("ascii", "replace")
        if not _NAME.match(name):
            raise ShmError(f"{inp.peer}: malformed same-host segment name {name[:64]!r}")
        try:
            fd = os.open(os.path.join(_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None  # another host (or another user's rank)
        try:
            if os.fstat(fd).st_size != cls.size_for(cap):
                return None
            mm = mmap.mmap(fd, cls.size_for(cap))
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC or mm[8:24] != token:
            mm.close()
            return None
        return cls(mm, 1, cap, inp)

    # A swap is begin() -> write this rank's frame at frame_offset(mine) -> publish() ->
    # await_peer() -> read the peer's frame; `exchange` does all of it for a (head, payload), and
    # a `Lane` for frames of one fixed header and size written in place.

    @property
    def buffer(self) -> mmap.mmap:
        """The segment (for callers that keep typed views of their frames)."""
        return self._mm

    def forget_headers(self) -> None:
        """No slot holds a known header any more (its owner's lanes are being dropped)."""
        self.header_of[:] = [None, None]

    def frame_offset(self, mine: bool, parity: int) -> int:
        """Byte offset of this rank's (or the peer's) frame for swaps of `parity`; 64-aligned."""
        return self._off(self._me if mine else 1 - self._me, parity) + _SLOT_HEAD

    def begin(self) -> int:
        """The next swap's number c (its frames live in the slots of parity c & 1)."""
        self.count += 1
        return self.count

    def publish(self, c: int, length: int) -> None:
        """This rank's frame of swap c (already written) is `length` bytes: make it visible.
        Slot word w holds the number c of the last swap published there, word w + 1 its length."""
        w = self._mine_word[c & 1]
        self._words[w + 1] = length
        self._words[w] = c  # stored after the frame: see the module docstring

    def peer_length(self, c: int) -> int:
        """Wait for the peer's frame of swap c; returns the length it published (unchecked)."""
        words, pw = self._words, self._peer_word[c & 1]
        if words[pw] != c:
            self.wait(pw, c)
        return words[pw + 1]

    def await_peer(self, c: int) -> int:
        """Wait for the peer's frame of swap c; returns its length (checked against the slot)."""
        length = int(self.peer_length(c))
        if not 0 <= length <= self._cap:
            raise ShmError(f"{self._inp.peer}: same-host frame length {length} out of range")
        return length

    def exchange(self, head: bytes, payload: Any) -> memoryview:
        """Swap one frame (`head` + `payload`, a buffer) with the peer; returns a view of the
        peer's frame, valid until this rank's next-but-one exchange (copy out before then)."""
        n = payload.nbytes
        if len(head) + n > self._cap:
            raise ShmError(f"a {len(head) + n}-byte frame exceeds the {self._cap}-byte slot")
        c = self.begin()
        self.header_of[c & 1] = None
        off, view = self.frame_offset(True, c & 1), self._view
        view[off : off + len(head)] = head
        if n:
            view[off + len(head) : off + len(head) + n] = memoryview(payload).cast("B")
        self.publish(c, len(head) + n)
        length = self.await_peer(c)
        start = self.frame_offset(False, c & 1)
        return view[start : start + length]

    def wait(self, word: int, c: int) -> None:
        """Until `words[word] == c`: spin (yielding the core), then nap; fails on a dead peer
        (PeerClosedError), a peer gone into another op (PeerDivergedError) or the op timeout."""
        inp, words = self._inp, self._words
        start = time.monotonic()
        end_spin = start + min(self.spin, inp.timeout)
        while time.monotonic() < end_spin:
            _sched_yield()
            if words[word] == c:
                return
        nap = 20e-6
        while words[word] != c:
            if inp._pin.poll(0) and self._peer_sent_tcp() and words[word] != c:
                raise PeerDivergedError(
                    f"{inp.peer} sent a TCP frame while this rank waited for its same-host frame",
                    self._peek(fr.FIXED_SIZE),
                )
            waited = time.monotonic() - start
            if waited > inp.timeout:
                raise inp._stalled("receiving (same-host)")
            time.sleep(nap)
            # naps grow to 1 ms; past a second (an idle worker waiting for the next step) to
            # 5 ms, so an idle group does not wake a thousand times a second
            nap = min(2 * nap, 1e-3 if waited < 1.0 else 5e-3)

    def _peer_sent_tcp(self) -> bool:
        """The TCP socket turned readable during a swap: raise if the peer closed it (it died);
        True if it holds bytes. A peer sends TCP bytes for a later op only after publishing its
        frame here (its seq store precedes its send), so bytes with no frame mean another op."""
        return bool(self._peek(1))

    def _peek(self, n: int) -> bytes:
        """Up to n bytes waiting on the TCP socket, without consuming them (b"" if none)."""
        try:
            got = self._inp.sock.recv(n, socket.MSG_PEEK)
        except BlockingIOError:
            return b""
        except OSError as e:
            raise PeerClosedError(f"{self._inp.peer}: connection lost ({e})") from e
        if not got:
            raise PeerClosedError(f"{self._inp.peer}: peer closed the connection")
        return got

    def close(self) -> None:
        try:
            self._words.release()
            self._view.release()
            self._mm.close()
        except BufferError:  # a caller still holds a view of a frame: the mapping goes with it
            pass


class Lane:
    """Swaps, in place, frames of one fixed header `head` (seq field left 0) and one payload size:
    per slot parity, this rank's frame and the peer's sit at fixed offsets, so a caller keeps
    typed views of both payloads (`mine[p]`, `peer[p]`, built once by `view(segment, offset)`)
    and writes its payload straight into the segment. A swap:

        p = lane.begin()              # the next swap's parity
        ... write the payload into mine[p] ...
        ok = lane.exchange(p, seq)    # header (seq stored), publish, wait for the peer's frame
        ... read peer[p] (valid until this rank's next-but-one swap) when ok ...

    `exchange` is False when the peer's frame differs in length or in any header byte (another
    op, seq or shape): the caller's desync. The header is rewritten only when the slot last held
    another lane's (or `exchange`'s) frame, and then only its seq word changes."""

    __slots__ = ("head", "hlen", "length", "mine", "peer", "_pair", "_mine_at", "_peer_at", "_seq")

    def __init__(
        self, pair: SamePair, head: bytes, payload_nbytes: int, view: Callable[[Any, int], Any]
    ) -> None:
        if len(head) + payload_nbytes > pair._cap:
            raise ShmError(
                f"a {len(head) + payload_nbytes}-byte frame exceeds the {pair._cap}-byte slot"
            )
        self._pair, self.head, self.hlen = pair, head, len(head)
        self.length = len(head) + payload_nbytes
        self._mine_at = tuple(pair.frame_offset(True, p) for p in (0, 1))
        self._peer_at = tuple(pair.frame_offset(False, p) for p in (0, 1))
        self._seq = tuple((at + fr.SEQ_OFFSET) // 8 for at in self._mine_at)  # 8-aligned word
        self.mine = tuple(view(pair.buffer, at + self.hlen) for at in self._mine_at)
        self.peer = tuple(view(pair.buffer, at + self.hlen) for at in self._peer_at)

    def begin(self) -> int:
        """Begin the pair's next swap (as `SamePair.begin`); returns its parity."""
        pair = self._pair
        c = pair.count = pair.count + 1
        return c & 1

    def exchange(self, p: int, seq: int) -> bool:
        """Publish this rank's frame of the swap just begun, with `seq` in its header, and wait
        for the peer's; True when the peer's frame equals it in length and header bytes."""
        pair = self._pair
        c, mm, at = pair.count, pair._mm, self._mine_at[p]
        if pair.header_of[p] is not self:
            mm[at : at + self.hlen] = self.head
            pair.header_of[p] = self
        pair._words[self._seq[p]] = seq
        pair.publish(c, self.length)
        if pair.peer_length(c) != self.length:
            return False
        peer = self._peer_at[p]
        return mm[at : at + self.hlen] == mm[peer : peer + self.hlen]

    def headers(self, p: int) -> tuple[bytes, bytes]:
        """(this rank's header, the peer's) of the swaps of parity p: a desync's evidence."""
        mm, at, peer = self._pair._mm, self._mine_at[p], self._peer_at[p]
        return mm[at : at + self.hlen], mm[peer : peer + self.hlen]


def negotiate(rank: int, out: Channel, inp: Channel, cap: int, enabled: bool) -> SamePair | None:
    """Rank 0 offers a segment on `out`, rank 1 answers yes or no on its `out`; both return the
    pair, or None (both), so the two ranks always agree. `enabled`: this rank's own opt-in
    (TANDEM_SHM); off on either rank keeps the pair on TCP."""
    if rank == 0:
        pair, offer, path = None, b"", ""
        if enabled and supported():
            try:
                pair, offer, path = SamePair.create(cap, inp.ts)
            except OSError:
                pair = None  # no /dev/shm space or permission: TCP
        try:
            out.send_array(
                op=fr.HANDSHAKE, seq=0, dtype_code=wd.UINT8.code, shape=(len(offer),),
                payload=offer,
            )  # fmt: skip
            _, verdict = inp.recv_array(op=fr.HANDSHAKE, seq=0, max_bytes=1)
        except BaseException:
            if pair is not None:
                pair.close()
            raise
        finally:
            if path:
                os.unlink(path)
        if pair is not None and bytes(verdict) != b"\x01":
            pair.close()
            pair = None
        return pair
    _, offer = inp.recv_array(op=fr.HANDSHAKE, seq=0, max_bytes=_MAX_OFFER)
    pair = None
    if offer and enabled and supported():
        pair = SamePair.attach(bytes(offer), cap, inp.ts)
    out.send_array(
        op=fr.HANDSHAKE, seq=0, dtype_code=wd.UINT8.code, shape=(1,),
        payload=b"\x01" if pair is not None else b"\x00",
    )  # fmt: skip
    return pair
