"""The fault drill's pause figures (`tandem.bench.fault_drill`), on timelines written out by hand:
a stream's pause is its longest gap that ends after the fault (a gap before it is a step, not a
pause), and `pause_bound` adds the heartbeat's detection bound, the measured re-form, and the
quiet run's slowest first text and two of its longest gaps."""

import pytest

from tandem.bench.fault_drill import DrillResult, StreamResult, pause_bound
from tandem.transport.heartbeat import BEATS_PER_TIMEOUT


def _stream(*times: float) -> StreamResult:
    return StreamResult(text="x" * len(times), times=list(times), done=True)


def _drill(streams, health, t_fault=10.0, t_start=9.0) -> DrillResult:
    return DrillResult(streams, health, t_start=t_start, t_fault=t_fault, in_flight_at_fault=2)


def test_a_pause_is_the_longest_gap_ending_after_the_fault():
    # a 7 s stall before the fault (a slow prefill) does not count; the 6.5 s one after it does
    a = _stream(1.0, 8.0, 9.8, 16.3, 16.4)
    b = _stream(9.6, 9.7, 9.9, 17.0, 17.1)  # its step in flight finished before the fault
    finished = _stream(9.2, 9.3)  # done before the fault: no pause
    drill = _drill([a, b, finished], [])
    assert drill.pauses == pytest.approx([6.5, 7.1, 0.0])
    assert _drill([a], [], t_fault=None).pauses == []


def test_the_bound_is_detection_plus_the_measured_reform_plus_a_replay():
    quiet = DrillResult([_stream(1.3, 1.4, 1.6), _stream(1.5, 1.55)], [], t_start=1.0)
    assert quiet.slowest_first_s == pytest.approx(0.5)
    assert quiet.longest_gap_s == pytest.approx(0.2)
    # 503 at 1.9 s (before the heartbeat's bound), 200 at 8.4 s: re-formed in 6.5 s
    health = [(0.5, 200, ""), (1.9, 503, "re-forming"), (5.0, 503, "re-forming"), (8.4, 200, "")]
    drill = _drill([_stream(9.9, 18.6)], health)
    detect = 2.0 * (1 + 1 / BEATS_PER_TIMEOUT)
    assert pause_bound(drill, quiet, 2.0) == pytest.approx(detect + 6.5 + 0.5 + 2 * 0.2 + 0.1)
    # a 503 seen later than the heartbeat's bound (a loaded machine) counts as measured
    late = _drill([_stream(9.9, 18.6)], [(3.0, 503, "re-forming"), (9.5, 200, "")])
    assert pause_bound(late, quiet, 2.0) == pytest.approx(3.0 + 6.5 + 0.5 + 0.4 + 0.1)


def test_a_drill_that_never_saw_the_503_and_the_200_has_no_bound():
    quiet = DrillResult([_stream(1.3, 1.4)], [], t_start=1.0)
    never_whole = _drill([_stream(9.9)], [(1.9, 503, "re-forming")])
    with pytest.raises(ValueError, match="no 503 and 200"):
        pause_bound(never_whole, quiet, 2.0)
