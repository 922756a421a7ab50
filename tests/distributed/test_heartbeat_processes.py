"""Heartbeats across real processes on loopback (`transport.heartbeat`): a ring or star rank that hangs
(SIGSTOP: every socket stays open and silent, as behind a blackholed link) is declared lost by
its neighbours within the heartbeat timeout, far below the op timeout, and the all_reduce they
wait in fails at once with PeerLostError naming it; a rank busy computing for longer than
the heartbeat timeout, in torch kernels or in pure Python, is not lost (its heartbeat thread does
not wait for the compute).

The op timeout is set to 60 s, so any failure inside the bound came from the heartbeat."""

from __future__ import annotations

import pytest
from comm_harness import run_world
from comm_scenarios import hang_or_busy, stopped_mid_stream

OP_TIMEOUT_S = 60.0
HEARTBEAT_S = 2.0
BOUND_S = 2 * HEARTBEAT_S  # timeout + one beat interval + a loaded 2-core machine's slack


def _options(shm: bool) -> dict:
    return dict(op_timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S, shared_memory=shm)


def _check_lost(survivors: list, victim: int) -> None:
    """Every survivor failed within the bound with a transport error; at least one (each, when
    it is the victim's only neighbour) with PeerLostError naming the victim and the heartbeat."""
    for res in survivors:
        assert res["error"] is not None and "TransportError" in res["mro"], res
        assert res["elapsed"] <= BOUND_S < OP_TIMEOUT_S / 10, res
    lost = [r for r in survivors if r["error"] == "PeerLostError"]
    assert lost, survivors
    for res in lost:
        assert res["lost_rank"] == victim, res
        assert f"rank {victim} is lost" in res["msg"] and "heartbeat" in res["msg"], res
        assert "PeerTimeoutError" in res["mro"], res  # handled as any stalled peer is


@pytest.mark.parametrize(
    "world,shm", [(2, True), (2, False), (3, False)], ids=["n2-shm", "n2-tcp", "n3-tcp"]
)
def test_a_stopped_rank_is_lost_within_the_heartbeat_timeout_not_the_op_timeout(
    world: int, shm: bool
) -> None:
    results = run_world(
        "ring",
        world,
        hang_or_busy,
        ("stop", 1, 4 * HEARTBEAT_S),
        options=_options(shm),
        allow_errors=True,
        timeout=120,
        wait_for=[r for r in range(world) if r != 1],
    )
    survivors = [r for i, r in enumerate(results) if i != 1]
    _check_lost(survivors, 1)
    if world == 2:  # the victim's only neighbour: it names the heartbeat itself
        assert survivors[0]["error"] == "PeerLostError", survivors


def test_a_rank_stopped_inside_a_large_all_reduce_is_lost_within_the_heartbeat_timeout() -> None:
    results = run_world(
        "ring",
        3,
        stopped_mid_stream,
        (2, 4 * HEARTBEAT_S),
        options=_options(False),
        allow_errors=True,
        timeout=120,
        wait_for=[0, 1],
    )
    survivors = results[:2]
    _check_lost(survivors, 2)


@pytest.mark.parametrize(
    "mode,shm",
    [("busy", True), ("busy", False), ("busy_python", False)],
    ids=["torch-shm", "torch-tcp", "python-tcp"],
)
def test_a_rank_busy_computing_past_the_heartbeat_timeout_is_not_lost(mode: str, shm: bool) -> None:
    busy_s = 2.5 * HEARTBEAT_S
    results = run_world(
        "ring", 2, hang_or_busy, (mode, 1, busy_s), options=_options(shm), timeout=120
    )
    waiter, busy = results
    assert waiter["error"] is None and busy["error"] is None, results
    assert waiter["sum"] == busy["sum"] == 2.0
    assert busy["busy_s"] >= busy_s and busy["matmuls"] > 0, busy
    assert waiter["elapsed"] >= HEARTBEAT_S, waiter  # it waited past the heartbeat timeout


STAR = dict(op_timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S)


@pytest.mark.parametrize(
    "world,victim", [(2, 1), (3, 1), (2, 0)], ids=["n2-worker", "n3-worker", "n2-root"]
)
def test_a_stopped_star_rank_is_lost_within_the_heartbeat_timeout_not_the_op_timeout(
    world: int, victim: int
) -> None:
    """A star (`comm.star`, a RING_CONFIG's backend "star"): a hung worker is lost on the root,
    which breaks the star so the other workers fail at once too; a hung root on its workers."""
    results = run_world(
        "star",
        world,
        hang_or_busy,
        ("stop", victim, 4 * HEARTBEAT_S),
        options=STAR,
        allow_errors=True,
        timeout=120,
        wait_for=[r for r in range(world) if r != victim],
    )
    survivors = [r for i, r in enumerate(results) if i != victim]
    _check_lost(survivors, victim)
    assert results[0 if victim else 1]["error"] == "PeerLostError", results  # the watcher


def test_a_star_worker_busy_computing_past_the_heartbeat_timeout_is_not_lost() -> None:
    busy_s = 2.5 * HEARTBEAT_S
    results = run_world("star", 2, hang_or_busy, ("busy", 1, busy_s), options=STAR, timeout=120)
    root, busy = results
    assert root["error"] is None and busy["error"] is None, results
    assert root["sum"] == busy["sum"] == 2.0
    assert busy["busy_s"] >= busy_s and root["elapsed"] >= HEARTBEAT_S, results
