"""Lining up the ranks' collective traces: the op's own time excludes waiting for the last rank."""

import pytest
import torch

from tandem.bench.optrace import TracedCommunicator, TraceMismatchError, analyze_traces
from tandem.comm.solo import SoloCommunicator


def _trace(*ops):
    return {"ops": [list(o) for o in ops]}


def test_sync_runs_from_the_last_arrival_to_the_first_return_and_skew_is_the_wait():
    r0 = _trace(("all_reduce_sum", 1.0, 3.5), ("broadcast", 4.0, 4.2))
    r1 = _trace(("all_reduce_sum", 3.0, 3.4), ("broadcast", 4.1, 4.3))
    out = analyze_traces([r0, r1], 0, 2)
    assert out["sync_s"] == pytest.approx((3.4 - 3.0) + (4.2 - 4.1))
    assert out["skew_s"] == pytest.approx(2.0 + 0.1)
    assert out["by_kind"]["all_reduce_sum"]["count"] == 1


def test_traces_listing_different_collectives_are_refused():
    with pytest.raises(TraceMismatchError, match="differs"):
        analyze_traces([_trace(("broadcast", 0, 1)), _trace(("all_to_all", 0, 1))], 0, 1)


def test_a_range_past_the_shortest_trace_is_refused():
    with pytest.raises(TraceMismatchError):
        analyze_traces([_trace(("broadcast", 0, 1)), _trace()], 0, 1)


def test_traced_communicator_forwards_results_unchanged_and_records_each_call():
    comm = TracedCommunicator(SoloCommunicator())
    t = torch.arange(4.0)
    assert torch.equal(comm.all_reduce_sum(t), t)
    comm.barrier()
    assert [op[0] for op in comm.ops] == ["all_reduce_sum", "barrier"]
    assert all(x >= e for _, e, x in comm.ops)
