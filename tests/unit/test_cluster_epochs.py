"""A joined worker learns the epoch to claim from the head's status board
(`tandem.cli.cluster_epochs`): the board's epoch at first, then only a higher epoch of the same
head or any epoch of a new head; a worker still running when its head forms a higher epoch has
been given up (a hung worker) and is replaced."""

import threading

import pytest

from tandem.cli.cluster_epochs import next_epoch, superseded
from tandem.cluster.launcher import free_ports
from tandem.cluster.status import StatusBoard
from tandem.cluster.token import new_topology


def test_a_worker_joins_the_boards_epoch_then_waits_for_a_higher_one_or_a_new_head():
    (port,) = free_ports(1)
    topo = new_topology(["127.0.0.1"] * 2, 2, 1, base_port=port - 3)  # status port: base + 3
    assert topo.status_port == port
    board = StatusBoard(topo.secret, port=port, world_size=2).start()
    try:
        board.update(0, head="h1")
        assert next_epoch(topo, None) == ("h1", 0)  # no re-form seen yet: epoch 0
        later = threading.Timer(0.5, lambda: board.update(0, epoch=1))
        later.start()
        assert next_epoch(topo, ("h1", 0), poll_s=0.05) == ("h1", 1)  # waited for epoch 1
        board.update(0, head="h2", epoch=0)
        assert next_epoch(topo, ("h1", 1), poll_s=0.05) == ("h2", 0)  # a new head: its epoch
        stop = threading.Event()
        stop.set()
        with pytest.raises(KeyboardInterrupt):
            next_epoch(topo, ("h2", 0), stop=stop)
    finally:
        board.close()


def test_a_running_worker_is_superseded_only_by_a_higher_epoch_of_its_own_head():
    (port,) = free_ports(1)
    topo = new_topology(["127.0.0.1"] * 2, 2, 1, base_port=port - 3)
    board = StatusBoard(topo.secret, port=port, world_size=2).start()
    try:
        board.update(0, head="h1", epoch=1)
        stale = superseded(topo, ("h1", 1), every_s=0.0)
        assert not stale()  # its own epoch: it serves
        board.update(0, head="h2", epoch=2)
        assert not stale()  # a new head: the old worker's links end with its head
        board.update(0, head="h1", epoch=2)
        assert stale()  # its head formed epoch 2 without it
    finally:
        board.close()
    assert not superseded(topo, ("h1", 1), every_s=0.0)()  # no board: not decided here
