"""The ring reuses its large work buffers across ops, but never a result the caller still holds."""

from __future__ import annotations

import threading

import torch

from tandem.comm.reference import all_reduce_sum
from tandem.comm.ring import RingCommunicator
from tandem.transport.endpoints import Listener
from tandem.transport.handshake import Identity


def _ring(world: int) -> list[RingCommunicator]:
    lis = [Listener("127.0.0.1", 0, Identity("t", r, world), None) for r in range(world)]
    comms: list = [None] * world

    def make(r: int) -> None:
        port = lis[(r + 1) % world].port
        comms[r] = RingCommunicator.create(
            r, world, right=("127.0.0.1", port), listener=lis[r], small_max_bytes=0
        )

    ts = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return comms


def _all(comms: list, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list = [None] * len(comms)
    ts = [
        threading.Thread(
            target=lambda r: out.__setitem__(r, comms[r].all_reduce_sum(xs[r])), args=(r,)
        )
        for r in range(len(comms))
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_a_held_result_is_never_overwritten_by_the_next_all_reduce() -> None:
    comms = _ring(2)
    try:
        first_in = [torch.randn(50_000) for _ in range(2)]
        held = _all(comms, first_in)
        snapshot = [h.clone() for h in held]
        view = held[0][10:20]  # a view alone must also keep the buffer from reuse
        del held
        for _ in range(3):
            again = _all(comms, [torch.randn(50_000) for _ in range(2)])
            assert torch.equal(again[0], again[1])
        assert torch.equal(view, snapshot[0][10:20])
        dropped = _all(comms, first_in)  # the previous results were dropped: reuse is allowed
        assert torch.equal(dropped[0], all_reduce_sum(first_in, small_max_bytes=0)[0])
    finally:
        for c in comms:
            c.close()
