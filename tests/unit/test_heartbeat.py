"""Heartbeats in one process (`transport.heartbeat`): two `Heartbeat` threads over a real TCP
pair keep each other alive past the timeout; one that falls silent with its socket open (hung) is
declared lost by the other within timeout + a beat, naming its rank; a closed or malformed
heartbeat connection is dropped from the watch, not a loss; a watcher that loses a neighbour the
head does not see REPORTs it to the head, which declares that rank lost at once, naming the link;
the test seam that dials a link through a relay routes only the links it names. And the flag and config: one shared
default on serve, launch (forwarded to its serve), cluster join and worker; 0 turns heartbeats
off; anything else not above 0 is refused typed."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tandem.cli.launch import serve_argv
from tandem.cli.main import build_parser
from tandem.cluster.ring_config import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    TimeoutValueError,
    check_heartbeat_timeout,
    parse_ring_config,
)
from tandem.transport.channel import Channel
from tandem.transport.handshake import Identity
from tandem.transport.heartbeat import Heartbeat, PeerLostError, beat_frame
from tandem.transport.socketio import TimedSocket

TIMEOUT_S = 0.6


def _pair(r0: int = 0, r1: int = 1, world: int = 2) -> tuple[Channel, Channel]:
    with socket.create_server(("127.0.0.1", 0)) as srv:  # a real TCP pair on loopback
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    ids = [Identity("c", r0, world, role="beat"), Identity("c", r1, world, role="beat")]
    ch0 = Channel(TimedSocket(a, "rank 1", 5.0), ids[0], ids[1], 64)
    ch1 = Channel(TimedSocket(b, "rank 0", 5.0), ids[1], ids[0], 64)
    return ch0, ch1


class _Seen:
    def __init__(self) -> None:
        self.lost: list[tuple[float, PeerLostError]] = []
        self.event = threading.Event()

    def __call__(self, e: PeerLostError) -> None:
        self.lost.append((time.monotonic(), e))
        self.event.set()


def test_two_live_peers_outlive_the_timeout_and_a_silent_one_is_lost_naming_its_rank() -> None:
    ch0, ch1 = _pair()
    seen0, seen1 = _Seen(), _Seen()
    hb0 = Heartbeat(0, [ch0], TIMEOUT_S, seen0)
    hb1 = Heartbeat(1, [ch1], TIMEOUT_S, seen1)
    try:
        time.sleep(4 * TIMEOUT_S)
        assert not seen0.lost and not seen1.lost
        hb1._stop.set()  # rank 1 falls silent; its socket stays open, as when it is stopped
        t_silent = time.monotonic()
        assert seen0.event.wait(10 * TIMEOUT_S)
        t_lost, e = seen0.lost[0]
        assert e.rank == 1 and "rank 1 is lost" in str(e) and "heartbeat" in str(e)
        assert isinstance(e, TimeoutError) and hb0.lost is e
        assert t_lost - t_silent <= 2 * TIMEOUT_S + 0.5, t_lost - t_silent
    finally:
        hb0.close()
        hb1.close()


def test_a_neighbour_lost_on_a_link_the_head_does_not_see_is_reported_to_the_head() -> None:
    """Ranks 0 (the head), 1 and 2: each of 1 and 2 beats the head and the other (a pipeline's
    star plus its stage link 1 -> 2). Rank 2 stops beating rank 1 only, as if that link went dark:
    the head still hears both, so only rank 1's REPORT can tell it."""
    h1, s1 = _pair(0, 1, 3)  # head <-> rank 1
    h2, s2 = _pair(0, 2, 3)  # head <-> rank 2
    a, b = _pair(1, 2, 3)  # rank 1 <-> rank 2: the stage link's heartbeat
    head, at1, at2 = _Seen(), _Seen(), _Seen()
    hb0 = Heartbeat(0, [h1, h2], TIMEOUT_S, head)
    hb1 = Heartbeat(1, [s1, a], TIMEOUT_S, at1, report_to=0)
    hb2 = Heartbeat(2, [s2], TIMEOUT_S, at2, report_to=0)  # rank 2 never beats on `b`
    try:
        assert head.event.wait(10 * TIMEOUT_S)
        _, e = head.lost[0]
        assert at1.event.wait(10 * TIMEOUT_S) and at1.lost[0][1].rank == 2  # it REPORTs first
        assert e.rank == 2 and isinstance(e, PeerLostError), e
        assert "rank 2 is lost: rank 1 reports" in str(e), e
        assert "link between rank 1 and rank 2" in str(e), e
    finally:
        for hb in (hb0, hb1, hb2):
            hb.close()
        b.close()


def test_the_relay_seam_routes_only_the_links_it_names(monkeypatch) -> None:
    from tandem.transport.relay_seam import ENV, RelaySettingError, relay_for

    assert relay_for(1, 0) is None  # unset: everything direct
    monkeypatch.setenv(ENV, "127.0.0.1:9/1")
    assert relay_for(1, 0) == relay_for(0, 1) == relay_for(1, None) == ("127.0.0.1", 9)
    assert relay_for(0, 2) is None
    monkeypatch.setenv(ENV, "127.0.0.1:9/1-2")
    assert relay_for(1, 2) == relay_for(2, 1) == ("127.0.0.1", 9)
    assert relay_for(0, 1) is None and relay_for(2, 0) is None
    for bad in ("127.0.0.1:9", "9/1", "127.0.0.1:x/1", "127.0.0.1:9/a-b"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(RelaySettingError, match=ENV):
            relay_for(1, 0)


@pytest.mark.parametrize("how", ["closed", "malformed"])
def test_a_closed_or_malformed_heartbeat_connection_is_dropped_not_lost(how: str) -> None:
    ch0, ch1 = _pair()
    seen = _Seen()
    hb0 = Heartbeat(0, [ch0], TIMEOUT_S, seen)
    try:
        if how == "closed":
            ch1.close()
        else:
            ch1.ts.sock.sendall(b"X" * 40 + beat_frame(1))
        assert not seen.event.wait(4 * TIMEOUT_S)
        assert hb0.lost is None
    finally:
        hb0.close()
        ch1.close()


def test_one_default_on_every_command_and_launch_forwards_it_to_its_serve() -> None:
    for argv in (
        ["serve"],
        ["launch"],
        ["cluster", "join", "t"],
        [
            "stage",
            "--model",
            "m",
            "--stage",
            "1",
            "--layers",
            "0:1",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--upstream-rank",
            "0",
            "--cluster-id",
            "c",
        ],
    ):
        args = build_parser().parse_args(argv)
        assert args.heartbeat_timeout == DEFAULT_HEARTBEAT_TIMEOUT_S == 3.0, argv
    assert build_parser().parse_args(["worker", "--model", "m"]).heartbeat_timeout is None
    args = build_parser().parse_args(["launch", "--heartbeat-timeout", "1.5"])
    out = serve_argv(args, args.model or "m")
    assert out[out.index("--heartbeat-timeout") + 1] == "1.5"


def test_zero_turns_heartbeats_off_and_anything_else_not_above_zero_is_refused() -> None:
    assert check_heartbeat_timeout(0) == 0.0 and check_heartbeat_timeout(2) == 2.0
    for bad in (-1, float("inf"), float("nan"), True, "3"):
        with pytest.raises(TimeoutValueError, match="heartbeat_timeout"):
            check_heartbeat_timeout(bad)
    base = {"rank": 0, "world_size": 2, "port": 1, "right_ip": "127.0.0.1", "right_port": 2}
    assert parse_ring_config(base).heartbeat_timeout == DEFAULT_HEARTBEAT_TIMEOUT_S
    assert parse_ring_config({**base, "heartbeat_timeout": 0}).heartbeat_timeout == 0.0
    with pytest.raises(TimeoutValueError, match="heartbeat_timeout"):
        parse_ring_config({**base, "heartbeat_timeout": -2})


def test_a_pipeline_names_a_lost_rank_by_its_stage_and_its_tp_rank_in_a_grid() -> None:
    from tandem.engine.pp.beats import place_of

    assert place_of([[0], [1]], 1) == "stage 1"
    assert place_of([[0, 1], [2, 3]], 1) == "stage 0, TP rank 1"
    assert place_of([[0, 1], [2, 3]], 2) == "stage 1, TP rank 0"
    assert place_of([[0], [1]], 5) == "not in the grid"


def test_the_lost_ranks_place_comes_right_after_the_loss_where_health_keeps_it() -> None:
    """/health shows an unauthenticated caller the first PUBLIC_DETAIL_CHARS of the reason: the
    place rides right after "rank N is lost", ahead of the heartbeat's long explanation."""
    from tandem.engine.pp.beats import named_loss
    from tandem.server.app import PUBLIC_DETAIL_CHARS, public_detail

    said = "rank 0: rank 3 is lost: no heartbeat for 2.0 s (" + "x" * 300 + ")"
    named = named_loss(said, 3, [[0, 1], [2, 3]])
    assert named.startswith("rank 0: rank 3 is lost (stage 1, TP rank 1): no heartbeat for 2.0 s")
    shown = public_detail(f"re-forming (epoch 2): the pipeline failed during a step: {named}")
    assert len(shown) == PUBLIC_DETAIL_CHARS and "rank 3 is lost (stage 1, TP rank 1)" in shown
    assert named_loss("rank 1 stopped", 1, [[0], [1]]) == "rank 1 stopped (stage 1)"


def test_tandem_stage_refuses_a_heartbeat_timeout_not_above_zero() -> None:
    from tandem.cli.stage import run

    argv = ["stage", "--model", "m", "--stage", "1", "--layers", "0:1", "--rank", "1",
            "--world-size", "2", "--upstream-rank", "0", "--cluster-id", "c",
            "--heartbeat-timeout", "-1"]  # fmt: skip
    with pytest.raises(TimeoutValueError, match="heartbeat-timeout"):
        run(build_parser().parse_args(argv))
