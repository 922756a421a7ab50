"""Regression tests named for the four bugs of the cross-vendor TP paper, plus failure modes:
each across real processes on loopback unless the property is about the code's shape."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch
from comm_harness import run_world
from comm_scenarios import (
    big_all_reduce,
    conformance,
    desync,
    mixed_dtypes,
    simple_sum,
    stall_or_die,
)

from tandem.comm import ring as ring_mod
from tandem.comm import staging
from tandem.comm import star as star_mod
from tandem.comm.ring import RingCommunicator
from tandem.comm.star import StarCommunicator
from tandem.transport.endpoints import Listener
from tandem.transport.handshake import Identity
from tandem.wire import frame as fr

COMM_DIR = Path(ring_mod.__file__).parent


def test_len_squared_byte_count_regression_many_sizes() -> None:
    # Bug 1: a len^2 byte count is invisible at one element and fatal above; sweep many lengths.
    sizes = list(range(1, 34)) + [127, 128, 129, 1021, 4093, 16381, 16384, 16411, 65521, 131071]
    for n in sizes:  # the header's length is n * itemsize, never n * n * itemsize
        head = fr.encode_header(fr.DATA, fr.ALL_REDUCE, 1, 1, 0, (n,))
        assert fr.FIXED.unpack(head[: fr.FIXED_SIZE])[-1] == 4 * n
    cases = [("all_reduce", n, n) for n in sizes] + [("all_gather", n, n) for n in (1, 2, 33, 1021)]
    results = run_world("ring", 3, conformance, (cases, dict(algorithm=None)))
    assert all(ok for res in results for _, ok, _ in res)


def test_missing_backend_arm_regression_every_backend_stages_through_one_function(
    monkeypatch,
) -> None:
    # Bug 2: a device type with no host-staging arm. Statically: no comm module but staging.py
    # moves a tensor to the host itself. Dynamically: every op of ring and star calls the one
    # staging function, for every device type this torch build can make.
    host_moves = re.compile(r"\.cpu\(\)|\.numpy\(\)|to\(\s*[\"']cpu|device=[\"']cpu")
    for path in COMM_DIR.glob("*.py"):
        if path.name not in ("staging.py",):
            assert not host_moves.search(path.read_text()), f"{path.name} stages to host on its own"
    devices = ["cpu"] + [
        d
        for d in ("cuda", "mps", "xpu")
        if getattr(torch, d, None) and getattr(torch, d).is_available()
    ]
    seen: list[str] = []
    real = staging.host_tensor  # the one crossing (stage_to_host is built on it)

    def counting(t: torch.Tensor, dtype: torch.dtype):
        seen.append(t.device.type)
        return real(t, dtype)

    for mod in (ring_mod, star_mod, staging):
        if hasattr(mod, "host_tensor"):
            monkeypatch.setattr(mod, "host_tensor", counting)
    for device in devices:
        for backend in ("ring", "star"):
            comms = _in_process_world(backend, 2)
            before = len(seen)
            outs: list = [None, None]

            def body(c, r: int, device: str = device, outs: list = outs) -> None:
                x = torch.full((6,), float(r + 1), device=device)
                outs[r] = [
                    c.all_reduce_sum(x),
                    c.reduce_scatter(x),
                    c.all_gather(x),
                    c.broadcast(x, 1),
                    c.all_to_all([x, x])[1],
                ]

            _run_threads(comms, body)
            assert all(o.device.type == device for res in outs for o in res)
            assert outs[0][0].tolist() == [3.0] * 6
            assert len(seen) - before >= 2 * 6, f"{backend} on {device}: ops bypassed host_tensor"
            assert set(seen[before:]) == {device}


def _in_process_world(backend: str, world: int) -> list:
    comms: list = [None] * world
    if backend == "ring":
        lis = [Listener("127.0.0.1", 0, Identity("t", r, world), None) for r in range(world)]

        def make(r: int) -> RingCommunicator:
            port = lis[(r + 1) % world].port
            return RingCommunicator.create(r, world, right=("127.0.0.1", port), listener=lis[r])
    else:
        root = Listener("127.0.0.1", 0, Identity("t", 0, world), None)

        def make(r: int) -> StarCommunicator:  # type: ignore[misc]
            mine = root if r == 0 else None
            return StarCommunicator.create(r, world, root=("127.0.0.1", root.port), listener=mine)

    _run_threads(comms, lambda c, r: comms.__setitem__(r, make(r)))
    return comms


def _run_threads(comms: list, fn) -> None:
    errors: list = []

    def wrap(r: int) -> None:
        try:
            fn(comms[r], r)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(r,), daemon=True) for r in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]


def test_handshake_race_regression_peer_starting_15_s_late_joins() -> None:
    # Bug 3: a 10 s handshake timeout raced uneven start-up. Rank 1 starts 15 s late.
    t0 = time.monotonic()
    results = run_world("ring", 2, simple_sum, options=dict(delays={1: 15.0}), timeout=120)
    assert time.monotonic() - t0 >= 15.0
    assert results == [[3.0] * 4, [3.0] * 4]


def test_dtype_hazard_regression_f16_rank_and_bf16_rank_sum_correctly() -> None:
    # Bug 4: an f16 rank and a bf16 rank reinterpreting each other's 16-bit words.
    (out0, dt0, raw0), (out1, dt1, raw1) = run_world(
        "ring", 2, mixed_dtypes, (["float16", "bfloat16"],)
    )
    base = torch.tensor([1.5, -2.25, 0.75, 96.0, 3.0])
    expected = (base * 1 + base * 2).tolist()
    assert out0 == out1 == expected and (dt0, dt1) == ("torch.float16", "torch.bfloat16")
    # what a raw-bytes wire would have produced on rank 0: rank 1's bf16 words read as f16
    misread = torch.tensor(raw1, dtype=torch.int16).view(torch.float16).float()
    wrong = (base * 1 + misread).tolist()
    assert wrong != expected


def test_64_mb_all_reduce_at_n3_completes_bit_identical() -> None:
    results = run_world(
        "ring", 3, big_all_reduce, (16 * 1024 * 1024,), options=dict(op_timeout=120), timeout=300
    )
    assert all(ok for ok, _, _ in results)
    assert len({d for _, d, _ in results}) == 1


@pytest.mark.parametrize("shared_memory", [True, False])
def test_op_desync_between_processes_fails_closed_on_both_ranks(shared_memory: bool) -> None:
    # with shared memory, rank 0's all-reduce waits there while rank 1's all-gather goes by TCP
    options = dict(op_timeout=10, shared_memory=shared_memory)
    results = run_world("ring", 2, desync, options=options, allow_errors=True)
    assert [r[1] for r in results] == ["OpDesyncError", "OpDesyncError"], results


@pytest.mark.parametrize("world", [3, 2])
@pytest.mark.parametrize("mode", ["die", "stall"])
def test_dead_or_stalled_peer_raises_typed_error_within_the_op_timeout(
    mode: str, world: int
) -> None:
    # at N = 2 the survivor waits in same-host shared memory and watches the TCP socket
    timeout = 2.0
    results = run_world(
        "ring",
        world,
        stall_or_die,
        (mode, 1, 3 * timeout),
        options=dict(op_timeout=timeout, shared_memory=True),
        allow_errors=True,
        timeout=120,
        wait_for=[r for r in range(world) if r != 1],  # not the victim's sleep or last words
    )
    survivors = [results[0], results[2]] if world == 3 else [results[0]]
    if world == 2 and mode == "die":  # the closed socket is seen at once, not at the timeout
        assert survivors[0]["error"] == "PeerClosedError" and survivors[0]["elapsed"] < 1.0
    for res in survivors:
        assert res["error"] in ("PeerClosedError", "PeerTimeoutError"), res
        assert "TransportError" in res["mro"]
        assert res["elapsed"] < timeout + 1.5, res
    if (
        mode == "stall"
    ):  # the stalled peer's neighbour times out; the failure then cascades as a close
        assert "PeerTimeoutError" in {res["error"] for res in survivors}
