"""The TP weights that balance the ranks' compute measured in service (`tandem.engine.tp.balance`):
shares in proportion to share / compute, normalized to the slowest rank = 1."""

import time

from tandem.comm.metered import MeteredCommunicator
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.tp.balance import ComputeClock, balance_entry, balancing_weights, gather_clocks


def test_a_rank_twice_as_slow_per_share_gets_half_the_weight():
    assert balancing_weights([0.5, 0.5], [0.1, 0.2]) == (2.0, 1.0)
    # already 2:1 and balanced: the weights stay
    assert balancing_weights([2 / 3, 1 / 3], [0.2, 0.2]) == (2.0, 1.0)


def test_no_weights_before_a_step_or_where_a_clock_is_unknown():
    assert balancing_weights([0.5, 0.5], [0.1, -1.0]) is None
    assert balance_entry([0.5, 0.5], (1.0, 1.0), [(0.0, 0), (0.0, 0)]) is None
    entry = balance_entry([0.5, 0.5], (1.0, 1.0), [(0.2, 4), (0.4, 4)])
    assert entry == {
        "steps": 4,
        "compute_ms_per_step": [50.0, 100.0],
        "weights": [1.0, 1.0],
        "balanced_weights": [2.0, 1.0],
    }


def test_the_clock_leaves_out_the_time_inside_collectives():
    def body(comm):
        metered = MeteredCommunicator(comm)
        waiting, working = ComputeClock(metered), ComputeClock(metered)
        with waiting.step():  # 50 ms that the meter counts as inside collectives
            time.sleep(0.05)
            metered.stats.seconds += 0.05
        with working.step():  # 50 ms of the rank's own
            time.sleep(0.05)
        return waiting.compute_s, working.compute_s, gather_clocks(metered, working)

    for waited, worked, rows in run_ranks(ReferenceCommunicator.group(2), body):
        assert waited < 0.05 <= worked and rows == [(rows[0][0], 1), (rows[1][0], 1)]
    (unmetered,) = run_ranks(ReferenceCommunicator.group(1), lambda c: ComputeClock(c).row())
    assert unmetered.tolist() == [[-1.0, 0.0]]


def test_the_join_refinement_moves_only_a_split_that_is_off_by_more_than_its_margin():
    from tandem.engine.tp.refine import REFINE_MIN_CHANGE, agree_refinement, refined_weights

    # probed 3 : 1, but the fast rank took 120 ms for its 3/4 and the slow 60 for its 1/4
    assert refined_weights([0.75, 0.25], (3.0, 1.0), [(0.12, 8), (0.06, 8)]) == (1.5, 1.0)
    near = 1 + REFINE_MIN_CHANGE / 2  # within the margin: kept
    assert refined_weights([0.5, 0.5], (1.0, 1.0), [(0.1 / near, 8), (0.1, 8)]) is None
    assert refined_weights([0.5, 0.5], (1.0, 1.0), [(0.1, 8), (-1.0, 8)]) is None  # unknown
    for proposal in ((1.5, 1.0), None):
        seen = run_ranks(
            ReferenceCommunicator.group(2),
            lambda c, p=proposal: agree_refinement(c, p if c.rank == 0 else None),
        )
        assert seen == [proposal, proposal]  # the head's verdict on every rank
