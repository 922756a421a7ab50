"""Ranks that disagree on a broadcast's root fail with OpDesyncError on both sides of the
disagreement, over TCP (ring at N = 2 and 3, star at N = 2 and 3), at once rather than each
returning its own tensor; agreeing ranks still get the root's tensor. Real processes, loopback."""

from __future__ import annotations

import pytest
from comm_harness import run_world

# (backend, roots by rank, elements, ranks that must raise OpDesyncError); agreeing ranks from
# every root are the conformance suite's broadcast cases (test_comm_processes)
CASES = [
    ("ring", [0, 1], 100_000, {0, 1}),  # both think they are the root; past the 64 KB path
    ("ring", [0, 0, 1], 8, {0, 2}),  # rank 2 and its right neighbour, rank 0
    ("star", [1, 0], 8, {0, 1}),
    ("star", [0, 0, 2], 8, {0, 2}),
]


@pytest.mark.parametrize("backend,roots,n,raising", CASES)
def test_ranks_that_disagree_on_the_root_fail_with_op_desync_on_both_sides(
    backend: str, roots: list[int], n: int, raising: set[int]
) -> None:
    from comm_scenarios import broadcast_with_roots

    options = dict(op_timeout=10)
    if backend == "ring":
        options["shared_memory"] = False  # TCP: the same-host swap has its own test
    results = run_world(
        backend,
        len(roots),
        broadcast_with_roots,
        (roots, n),
        options=options,
        allow_errors=True,
        timeout=60,
    )
    failed = {r for r, res in enumerate(results) if res[0] == "error"}
    assert raising <= failed, results
    for r in raising:
        assert results[r][1] == "OpDesyncError", results
        assert "root" in results[r][2] or "expected" in results[r][2], results[r]
    for r, res in enumerate(results):  # nobody sat out the op timeout or returned a wrong value
        if res[0] == "error":
            assert res[1] == "OpDesyncError", results
        else:
            assert res[1] == float(roots[r] + 1), results
