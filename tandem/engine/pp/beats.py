"""A pipeline's heartbeats: one heartbeat connection between the head and every stage process.

The head owns `/health` and the re-form, so it is the head that must see a hung rank, and see it
itself: of a pipeline's data links only stage 1's and the last stage's touch the head, so a hung
middle stage, or a TP rank of a stage that is not its leader (it has no data link to the head at
all), would reach the head only by a cascade of timeouts. So the heartbeat links form a star
around the head: the head listens on a port of its own (role "beat", the same HMAC handshake and
claims as the stage links, `LinkTerms`), tells every stage process that address in its argv
(`--beat`), and each stage dials it once its data links are up. One `transport.heartbeat.Heartbeat`
thread on each side sends and watches the beats (it never waits for compute, so a long prefill
is not a hang).

A rank silent for the heartbeat timeout is declared lost on the head, naming its global rank and
its place in the grid; the head then shuts down its own stage links, so a step that waits for the
last stage's answer wakes at once (`PipelineExecutor._lose`), and `health()` is failed from that
moment, idle or mid-step. A stage that loses the head shuts down its links and leaves. A closed
heartbeat connection is not a loss (a process that exits closes its data links too).

The star sees every process, but not every link: a stage link between two stage processes (stage
k's leader to each rank of stage k+1, neither of them the head) can go dark while both ends still
beat the head, and the step would then wait for the op timeout. So each such link gets a heartbeat
connection of its own, formed the way a ring's are (`comm.ring_form.form_heartbeats`): the
downstream rank listens on a fresh port of its stage address (role "beat") and sends that port up
the link's unused reverse direction in one P2P frame (`offer_link_beat`), the upstream leader reads
it and dials (`dial_link_beat`), the downstream accepts (`accept_link_beat`). Both ends watch it
on the same `Heartbeat` thread as their beat to the head, with the head as `report_to`: the end
that declares its neighbour lost first REPORTs it to the head, whose own `Heartbeat` then declares
that rank lost at once, naming the link. Links that touch the head need none (the star covers
them: a dark link to the head silences that stage's beat too, as it runs between the same two
hosts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from tandem.engine.pp.frames import StageLinkError
from tandem.engine.pp.links import LinkTerms
from tandem.transport.channel import Channel
from tandem.transport.endpoints import Listener, connect
from tandem.transport.socketio import TransportError
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

ROLE = "beat"


def beat_listener(terms: LinkTerms, host: str) -> Listener:
    """The head's heartbeat listener (global rank 0), bound to an ephemeral port of `host`."""
    return Listener(host, 0, replace(terms.identity(0), role=ROLE), terms.secret)


def accept_beats(listener: Listener, terms: LinkTerms, ranks: Sequence[int]) -> list[Channel]:
    """One heartbeat channel from each of `ranks`, in the order they authenticate; each claims
    its rank once. StageLinkError naming the ranks missing when `handshake_timeout` passes."""
    waiting, got = set(ranks), []
    deadline = time.monotonic() + terms.handshake_timeout
    try:
        while waiting:
            ch = listener.accept(
                set(waiting),
                timeout=max(0.1, deadline - time.monotonic()),
                op_timeout=terms.op_timeout,
                max_frame_bytes=64,
            )
            waiting.discard(ch.peer_rank)
            got.append(ch)
    except TransportError as e:
        for ch in got:
            ch.close()
        raise StageLinkError(f"head: no heartbeat link from rank(s) {sorted(waiting)}: {e}") from e
    return got


def dial_beat(terms: LinkTerms, rank: int, addr: str) -> Channel:
    """Stage process `rank`'s heartbeat channel to the head listening at `addr` (host:port)."""
    host, _, port = addr.rpartition(":")
    try:
        return connect(
            host,
            int(port),
            replace(terms.identity(rank), role=ROLE),
            terms.secret,
            expect_rank=0,
            handshake_timeout=terms.handshake_timeout,
            op_timeout=terms.op_timeout,
            max_frame_bytes=64,
        )
    except TransportError as e:
        raise StageLinkError(f"rank {rank}: no heartbeat link to the head: {e}") from e


def offer_link_beat(terms: LinkTerms, rank: int, host: str, upstream: Channel) -> Listener:
    """Stage rank `rank`'s side of its upstream link's heartbeat: a listener on a fresh port of
    `host`, whose port goes up the link's reverse direction; `accept_link_beat` takes the call."""
    listener = Listener(host, 0, replace(terms.identity(rank), role=ROLE), terms.secret)
    try:
        port = np.array([listener.port], dtype=np.int64).tobytes()
        upstream.send_array(op=fr.P2P, seq=0, dtype_code=wd.INT64.code, shape=(1,), payload=port)
    except (TransportError, OSError) as e:
        listener.close()
        raise StageLinkError(f"rank {rank}: could not offer a heartbeat link upstream: {e}") from e
    except BaseException:
        listener.close()
        raise
    return listener


def accept_link_beat(listener: Listener, terms: LinkTerms, from_rank: int) -> Channel:
    """The heartbeat channel from upstream rank `from_rank` on `offer_link_beat`'s listener,
    which is closed either way."""
    try:
        return listener.accept(
            {from_rank},
            timeout=terms.handshake_timeout,
            op_timeout=terms.op_timeout,
            max_frame_bytes=64,
        )
    except TransportError as e:
        raise StageLinkError(f"no heartbeat link from rank {from_rank}: {e}") from e
    finally:
        listener.close()


def dial_link_beat(terms: LinkTerms, rank: int, to_rank: int, host: str, link: Channel) -> Channel:
    """Upstream leader `rank`'s heartbeat channel to downstream rank `to_rank` at `host`: the
    port comes down `link` (the stage link to it) from `offer_link_beat`."""
    try:
        header, got = link.recv_array(op=fr.P2P, seq=0, max_bytes=8)
    except (TransportError, fr.FrameError) as e:
        raise StageLinkError(f"rank {rank}: no heartbeat port from rank {to_rank}: {e}") from e
    if header.dtype != wd.INT64.code or header.shape != (1,):
        raise StageLinkError(
            f"rank {rank}: expected rank {to_rank}'s heartbeat port, got {header.describe()}"
        )
    port = int(np.frombuffer(got, dtype=np.int64)[0])
    try:
        return connect(
            host, port, replace(terms.identity(rank), role=ROLE), terms.secret,
            expect_rank=to_rank, handshake_timeout=terms.handshake_timeout,
            op_timeout=terms.op_timeout, max_frame_bytes=64,
        )  # fmt: skip
    except TransportError as e:
        raise StageLinkError(f"rank {rank}: no heartbeat link to rank {to_rank}: {e}") from e


def named_loss(said: str, rank: int, grid: Sequence[Sequence[int]]) -> str:
    """A heartbeat's loss message with the lost rank's place right after the loss ("rank 3 is
    lost (stage 1, TP rank 1): no heartbeat for ..."), early in the line, where /health's
    shortened detail keeps it; at the end where the message does not say "rank N is lost"."""
    lost, place = f"rank {rank} is lost", place_of(grid, rank)
    return said.replace(lost, f"{lost} ({place})", 1) if lost in said else f"{said} ({place})"


def place_of(grid: Sequence[Sequence[int]], rank: int) -> str:
    """Where global rank `rank` sits: "stage K" or "stage K, TP rank R" in a grid."""
    for k, ranks in enumerate(grid):
        if rank in ranks:
            return f"stage {k}" + (f", TP rank {list(ranks).index(rank)}" if len(ranks) > 1 else "")
    return "not in the grid"
