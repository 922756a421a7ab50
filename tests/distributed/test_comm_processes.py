"""Every backend across real processes on loopback equals the reference bit for bit, on every rank."""

from __future__ import annotations

import pytest
from comm_harness import run_world
from comm_scenarios import conformance

from tandem.comm import algorithms as alg

PRIMES = [2, 3, 5, 7, 13, 97, 1031, 4099, 65537, 262147]
CASES = (
    [
        ("all_reduce", n, i)
        for i, n in enumerate([1, 4, 16, 100, 1024, 1000, 16384, 100000, *PRIMES])
    ]
    + [("all_reduce_2d", n, i) for i, n in enumerate([1, 5, 600])]
    + [("row_invariant", 700, 3)]
    + [("reduce_scatter", n, i) for i, n in enumerate([1, 3, 7, 1024, 40961])]
    + [("all_gather", n, i) for i, n in enumerate([0, 1, 5, 1031, 70001])]
    + [("broadcast", n, i) for i, n in enumerate([1, 17, 100003])]
    + [("all_to_all", n, i) for i, n in enumerate([1, 9, 5003])]
    + [("rs_ag_identity", n, i) for i, n in enumerate([1, 7, 20011])]
    + [("ids", 5, 0)]
)


def _check(results: list, world: int) -> None:
    for name, *_ in results[0]:
        assert name  # every rank ran the same cases
    for r in range(world):
        bad = [name for name, ok, _ in results[r] if not ok]
        assert not bad, f"rank {r} differs from the reference on {bad}"
    # ops whose result is the same on every rank (reduce_scatter and all_to_all differ by design)
    same = ("all_reduce:", "all_gather:", "broadcast:", "all_reduce==", "ids:")
    digests = [[d for name, _, d in res if name.startswith(same)] for res in results]
    assert digests[0] and all(d == digests[0] for d in digests), "ranks disagree"


@pytest.mark.parametrize("world,shared_memory", [(2, True), (2, False), (3, None), (5, None)])
def test_ring_equals_reference_bit_for_bit_on_every_rank(world: int, shared_memory) -> None:
    # N = 2 twice: small all-reduces through same-host shared memory, and all over TCP
    mirror = dict(algorithm=None, small_max_bytes=alg.DEFAULT_SMALL_MAX_BYTES)
    options = dict(op_timeout=60, shared_memory=shared_memory)
    _check(run_world("ring", world, conformance, (CASES, mirror), options=options), world)


def test_ring_algorithm_on_tiny_and_empty_chunks_equals_reference() -> None:
    # small_max_bytes=0 forces reduce-scatter + all-gather even for 1..4 elements on 5 ranks
    cases = [("all_reduce", n, n) for n in [1, 2, 3, 4, 5, 6, 11, 1009]] + [
        ("reduce_scatter", 1, 0),
        ("rs_ag_identity", 3, 1),
    ]
    mirror = dict(algorithm=None, small_max_bytes=0)
    _check(run_world("ring", 5, conformance, (cases, mirror), options=dict(small_max_bytes=0)), 5)


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_ring_with_16_bit_wire_equals_reference_rounding_each_hop(wire: str) -> None:
    cases = [("all_reduce", n, n) for n in [1, 13, 1000, 70001]] + [
        ("reduce_scatter", 5003, 2),
        ("all_gather", 9, 1),
    ]
    mirror = dict(algorithm=None, small_max_bytes=alg.DEFAULT_SMALL_MAX_BYTES, wire_dtype=wire)
    _check(run_world("ring", 3, conformance, (cases, mirror), options=dict(wire_dtype=wire)), 3)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_star_equals_reference_bit_for_bit_on_every_rank(world: int) -> None:
    cases = [c for c in CASES if c[1] < 100000]
    mirror = dict(algorithm=alg.RANK_ORDER)
    _check(run_world("star", world, conformance, (cases, mirror)), world)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_gloo_equals_reference_bit_for_bit_on_every_rank(world: int) -> None:
    cases = [c for c in CASES if c[1] < 100000]
    mirror = dict(algorithm=alg.RANK_ORDER)
    _check(run_world("gloo", world, conformance, (cases, mirror)), world)


def _free_ports(k: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_from_env_ring_config_files_form_a_ring_and_torchrun_vars_a_star(tmp_path) -> None:
    import json

    from comm_scenarios import simple_sum

    world = 3
    ports = _free_ports(world)
    env = {}
    for r in range(world):
        cfg = {"master_ip": None if r == 0 else "127.0.0.1", "master_port": ports[0], "port": ports[r],
               "right_ip": "127.0.0.1", "right_port": ports[(r + 1) % world], "rank": r,
               "world_size": world, "secret": "0badc0de", "handshake_timeout": 60}  # fmt: skip
        path = tmp_path / f"ring{r}.json"
        path.write_text(json.dumps(cfg))
        env[r] = {"RING_CONFIG": str(path), "TANDEM_COMM": "ring"}
    assert run_world("env", world, simple_sum, options=dict(env=env)) == [[6.0] * 4] * world
    (master,) = _free_ports(1)
    env = {r: {"TANDEM_COMM": "star", "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master), "TANDEM_SECRET": "s"} for r in range(2)}  # fmt: skip
    assert run_world("env", 2, simple_sum, options=dict(env=env)) == [[3.0] * 4] * 2


# (rank 0's opt-in, rank 1's): shared memory only when both allow it, and then on both ranks
SHM_CASES = [(True, True), (False, False), (True, False), (False, True)]


@pytest.mark.parametrize("opt_in", SHM_CASES)
def test_two_rank_fast_path_meets_the_general_path_and_equals_reference(opt_in) -> None:
    from comm_scenarios import fast_path_meets_general_path

    options = dict(shared_memory_by_rank=list(opt_in))
    r0, r1 = run_world("ring", 2, fast_path_meets_general_path, options=options)
    base = [1.5, -2.25, 0.75, 96.0, 3.0, 0.5]
    assert r0["mixed"] == r1["mixed"] == [3 * v for v in base]
    assert r0["equal"] and r1["equal"] and r0["digest"] == r1["digest"]
    assert r0["shape"] == [1, 1, 1024]
    assert r0["same_host"] == r1["same_host"] == all(opt_in)  # agreed, both or neither
    assert r0["noncontiguous_equal"] and r1["noncontiguous_equal"]
    assert r0["grad_input_equal"] and r1["grad_input_equal"]
    assert r0["array_refused"] and r1["array_refused"]
    assert r0["usable_after_refusal"] and r1["usable_after_refusal"]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_two_rank_fast_path_refuses_a_shape_desync_on_both_ranks(shared_memory: bool) -> None:
    from comm_scenarios import fast_path_shape_desync

    options = dict(op_timeout=10, shared_memory=shared_memory)
    results = run_world("ring", 2, fast_path_shape_desync, options=options, allow_errors=True)
    assert [r[1] for r in results] == ["OpDesyncError", "OpDesyncError"], results


@pytest.mark.parametrize("kind", ["shape", "root", "op"])
def test_two_rank_same_host_broadcast_refuses_a_desync_on_both_ranks(kind: str) -> None:
    from comm_scenarios import broadcast_desync

    options = dict(op_timeout=10, shared_memory=True)
    results = run_world("ring", 2, broadcast_desync, (kind,), options=options, allow_errors=True)
    assert [r[1] for r in results] == ["OpDesyncError", "OpDesyncError"], results


def test_metered_ring_counts_each_collective_and_its_wire_bytes_by_the_ring_algorithm() -> None:
    from comm_scenarios import metered_counts

    r0, r1 = run_world("ring", 2, metered_counts, options=dict(op_timeout=30))
    # N = 2: rank order moves N (N - 1) s = 2 s, the ring 2 (N - 1) s = 2 s, a broadcast (N - 1) s;
    # floats travel at 4 bytes, integers at their own width
    want = 2 * 4 * 1024 + 2 * 4 * 4 + 2 * 4 * 70_000 + 8 * 5
    for r in (r0, r1):
        assert r["collectives"] == 4 and r["bytes"] == want and r["timed"]
        assert r["ints"] == [0, 1, 2, 3, 4]
    assert r0["digest"] == r1["digest"]


BIG_PRIME = 16_777_213  # 2^24 - 3, the largest size the issue names, and prime


@pytest.mark.parametrize(
    "backend,world",
    [("ring", 2), ("ring", 5), ("star", 2), ("star", 3), ("star", 5), ("gloo", 2), ("gloo", 3)],
)
def test_16m_prime_all_reduce_equals_reference_on_every_rank(backend: str, world: int) -> None:
    # ring at N = 3 is test_comm_paper_bugs' 64 MB all-reduce; together every N of the issue
    # (gloo runs at N = 2 and 3 throughout this file)
    from comm_scenarios import big_prime_all_reduce

    algorithm = None if backend == "ring" else alg.RANK_ORDER  # star; gloo in exact mode
    options = {} if backend == "gloo" else dict(op_timeout=120)  # gloo keeps its own timeout
    results = run_world(
        backend, world, big_prime_all_reduce, (BIG_PRIME, algorithm), options=options, timeout=300
    )
    assert all(ok for ok, _ in results), results
    assert len({d for _, d in results}) == 1
