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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from tandem.engine.pp.frames import StageLinkError
from tandem.engine.pp.links import LinkTerms
from tandem.transport.channel import Channel
from tandem.transport.endpoints import Listener, connect
from tandem.transport.socketio import TransportError

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


def place_of(grid: Sequence[Sequence[int]], rank: int) -> str:
    """Where global rank `rank` sits: "stage K" or "stage K, TP rank R" in a grid."""
    for k, ranks in enumerate(grid):
        if rank in ranks:
            return f"stage {k}" + (f", TP rank {list(ranks).index(rank)}" if len(ranks) > 1 else "")
    return "not in the grid"
