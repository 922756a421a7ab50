"""Heartbeats: a hung peer (SIGSTOP, a blackholed link, a host frozen in swap) is declared lost
within the heartbeat timeout, whatever the data path is doing.

Each link has its own heartbeat connection, authenticated by the same HMAC handshake as the data
connection (role "beat": `ring_form.form_heartbeats`), and one `Heartbeat` thread per
communicator owns every heartbeat connection of that process. A dedicated connection rather than a
frame kind interleaved on the data socket, because the data path has several readers that each
read a frame of known size straight into its buffer (`FrameReader.known`, the N = 2 fast path's
single `recv_into`, the same-host road's peek at the socket to tell a dead peer): a heartbeat
frame arriving between two of their frames would have to be filtered in every one of them, and
would add a lock to the latency path's sends. On its own connection a heartbeat never waits
behind a 100 MB frame, and the data path is unchanged.

Every `interval` (timeout / 6) the thread sends each peer one BEAT frame (the 40-byte fixed
header, no shape, no payload: `wire.frame`), and reads whatever its peers sent; any well-formed
BEAT counts as a sign of life, anything else ends the connection as malformed. A peer silent for
`timeout` seconds is declared lost: `on_lost(PeerLostError)` runs once, on this thread, and the
thread stops (so the peers of this process see it fall silent too). A peer that closes its
heartbeat connection has exited or closed its communicator: its data connection says so itself,
so a closed heartbeat connection is only dropped from the watch, never a loss.

A process that watches its neighbours on links the head does not see (a pipeline's stage-to-stage
links, `tandem.engine.pp.beats`) names the head as `report_to`: when it declares such a peer lost
it first sends the head one REPORT, a BEAT frame whose fingerprint field is 1 + the lost rank
(plain beats carry 0), then stops like any watcher. A REPORT read by a watcher is a loss declared
there at once, naming the silent link, as if that watcher had timed the silence itself.

Detection bound: a hung peer is declared lost between `timeout` and `timeout + interval` seconds
after its last beat (plus the wait for the GIL below). The thread never waits for compute: a send
is one non-blocking `sendmsg` of 40 bytes (skipped when the kernel buffer is full: the peer is
then not reading, and its silence is what counts), and every wait is a `poll` that releases the
GIL. torch's kernels and the project's C kernels (ctypes, which drops the GIL for the call) run
without the GIL, so a long prefill does not delay a beat; a pure-Python stretch hands the GIL over
every `sys.getswitchinterval()` (5 ms), so it delays a beat by at most that. Only a single C call
that holds the GIL for longer than the timeout could starve it; none on the step's path does.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

from tandem.transport.channel import Channel
from tandem.transport.socketio import PeerTimeoutError
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

log = logging.getLogger(__name__)

BEATS_PER_TIMEOUT = 6  # the send interval is timeout / 6: five beats may be lost before a loss
_RECV_BYTES = 4096


class PeerLostError(PeerTimeoutError):
    """A peer sent no heartbeat for the heartbeat timeout: hung, stopped, or cut off. `rank` names
    it. A PeerTimeoutError, so every handler of a stalled peer handles it the same way."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def beat_frame(n: int, lost: int | None = None) -> bytes:
    """The n-th BEAT frame: a fixed header with seq = n and nothing after it; with `lost`, the
    REPORT that rank `lost` went silent (fingerprint field 1 + lost)."""
    fp = 0 if lost is None else lost + 1
    return fr.pack_header(fr.BEAT, fr.P2P, wd.FLOAT32.code, 0, 0, n, fp, 0, b"")


class Heartbeat:
    """Rank `me`'s heartbeats over `links` (heartbeat channels, one per peer link; two may lead to
    the same rank, as at N = 2). `on_lost` runs once, on the heartbeat thread, when a peer has been
    silent for `timeout` seconds or a peer REPORTs a loss; a loss of any peer but `report_to` is
    first REPORTed to `report_to` (a rank among the links' peers, or None: no one)."""

    def __init__(
        self,
        me: int,
        links: Sequence[Channel],
        timeout: float,
        on_lost: Callable[[PeerLostError], None],
        report_to: int | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"a heartbeat timeout must be above 0 s, got {timeout!r}")
        self.me, self.timeout = me, float(timeout)
        self.interval = self.timeout / BEATS_PER_TIMEOUT
        self.links = list(links)
        self.lost: PeerLostError | None = None
        self._on_lost = on_lost
        self.report_to = report_to
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{me}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks = {ch.ts.sock.fileno(): ch for ch in self.links}
        poller = select.poll()
        for fd in socks:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        now = time.monotonic()
        heard = dict.fromkeys(socks, now)
        partial = dict.fromkeys(socks, b"")
        sent, next_beat = 0, now
        while not self._stop.is_set() and heard:
            now = time.monotonic()
            if now >= next_beat:
                sent += 1
                beat = beat_frame(sent)
                for fd in list(heard):
                    if not self._send(socks[fd], beat):
                        self._drop(poller, heard, fd)
                next_beat = now + self.interval
            for fd, _ in poller.poll(max(0.0, next_beat - time.monotonic()) * 1000):
                if fd in heard:
                    alive, partial[fd], reported = self._read(socks[fd], partial[fd])
                    if alive is None:
                        self._drop(poller, heard, fd)
                    elif alive:
                        heard[fd] = time.monotonic()
                    if reported is not None and not self._stop.is_set():
                        return self._declare(self._reported(socks[fd].peer_rank, reported), socks)
            now = time.monotonic()
            for fd, last in heard.items():
                if now - last > self.timeout and not self._stop.is_set():
                    peer = socks[fd].peer_rank
                    lost = PeerLostError(
                        f"rank {self.me}: rank {peer} is lost: no heartbeat for "
                        f"{now - last:.1f} s (heartbeat timeout {self.timeout:g} s): it is hung, "
                        "stopped or cut off",
                        peer,
                    )
                    return self._declare(lost, socks)

    def _reported(self, by: int, lost: int) -> PeerLostError:
        return PeerLostError(
            f"rank {self.me}: rank {lost} is lost: rank {by} reports no heartbeat from it for the "
            f"heartbeat timeout ({self.timeout:g} s) on the link between them: rank {lost} is "
            f"hung or stopped, or the link between rank {by} and rank {lost} is cut",
            lost,
        )

    def _declare(self, lost: PeerLostError, socks: dict[int, Channel]) -> None:
        """Reports `lost` to `report_to` (when it is another peer's loss), then `on_lost`."""
        self.lost = lost
        log.warning("%s", lost)
        if self.report_to is not None and lost.rank != self.report_to:
            for ch in socks.values():
                if ch.peer_rank == self.report_to:
                    self._send(ch, beat_frame(0, lost=lost.rank))
        self._on_lost(lost)

    @staticmethod
    def _drop(poller: select.poll, heard: dict, fd: int) -> None:
        poller.unregister(fd)
        del heard[fd]

    @staticmethod
    def _send(ch: Channel, beat: bytes) -> bool:
        """One non-blocking send; False once the connection is gone."""
        try:
            ch.ts.sock.send(beat)
        except BlockingIOError:
            pass  # the peer is not reading: its silence, not our send, decides
        except OSError:
            return False
        return True

    @staticmethod
    def _read(ch: Channel, held: bytes) -> tuple[bool | None, bytes, int | None]:
        """(whether a whole BEAT arrived, the bytes of a frame still incomplete, the rank a REPORT
        among them names or None); None first when the connection closed or carried something
        other than BEAT frames."""
        got = held
        while True:
            try:
                chunk = ch.ts.sock.recv(_RECV_BYTES)
            except BlockingIOError:
                break
            except OSError:
                return None, b"", None
            if not chunk:
                return None, b"", None
            got += chunk
        whole = len(got) - len(got) % fr.FIXED_SIZE
        reported = None
        for at in range(0, whole, fr.FIXED_SIZE):
            try:
                header, ndim = fr.decode_fixed(got[at : at + fr.FIXED_SIZE])
            except fr.FrameError:
                header, ndim = None, 0
            if header is None or header.kind != fr.BEAT or ndim or header.payload_len:
                log.warning("%s sent a malformed heartbeat; no longer watched", ch.ts.peer)
                return None, b"", None
            if header.fingerprint and reported is None:
                reported = header.fingerprint - 1
        return whole > 0, got[whole:], reported

    def close(self) -> None:
        """Stops beating and closes every heartbeat connection (the peers drop it from their
        watch)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval))
        for ch in self.links:
            try:
                ch.ts.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ch.close()
