"""`SequenceCache`: the one rule every runner and head checks a step by, and its one error."""

import pytest

from tandem.engine.executor import Step, StepSequence
from tandem.engine.local import StepError
from tandem.engine.pp.stage import StageOrderError
from tandem.engine.runner import StepOrderError
from tandem.engine.sequences import SequenceCache, SequenceError, SequenceTooLongError
from tandem.models import kv_cache


def step(*rows):
    return Step(tuple(StepSequence(i, tuple(t), p) for i, t, p in rows))


def test_the_old_error_names_are_the_one_error():
    assert StepError is StepOrderError is StageOrderError is SequenceError
    assert issubclass(SequenceTooLongError, SequenceError)
    assert issubclass(SequenceTooLongError, kv_cache.SequenceTooLongError)


def test_a_step_continues_or_rewinds_and_never_skips():
    c = SequenceCache(2, 16, vocab_size=100, owner="this stage")
    c.advance(step((7, [1, 2], 0)))
    assert c.cached(7) == 2 and c.check(step((7, [3], 2))) == [0]
    assert c.check(step((7, [1, 2, 3], 0))) == [0]  # a rewind (re-prefill) is allowed
    with pytest.raises(SequenceError, match="sequence 7 starts at 5 but this stage holds 2"):
        c.check(step((7, [3], 5)))
    with pytest.raises(SequenceError, match="start_pos 5"):
        c.check_rows([7], [5], [1])
    with pytest.raises(SequenceError, match="start_pos -1"):
        c.check(step((7, [3], -1)))
    with pytest.raises(SequenceError, match="starts at 3 but this stage holds 0"):
        c.check(step((8, [3], 3)))  # a sequence not seen starts at 0


@pytest.mark.parametrize(
    "bad,match",
    [
        (step(), "1..2 sequences, got 0"),
        (step((1, [1], 0), (2, [1], 0), (3, [1], 0)), "1..2 sequences, got 3"),
        (step((1, [1], 0), (1, [2], 0)), "appears twice"),
        (step((1, [], 0)), "sequence 1: no new tokens"),
        (step((1, [100], 0)), r"sequence 1: token id outside \[0, 100\)"),
        (step((1, [-1], 0)), "token id outside"),
    ],
)
def test_each_breach_of_the_rule_is_a_sequence_error(bad, match):
    with pytest.raises(SequenceError, match=match):
        SequenceCache(2, 16, vocab_size=100).check(bad)


def test_the_length_bound_is_the_too_long_error_and_nothing_changes_on_a_refusal():
    c = SequenceCache(2, 16)
    with pytest.raises(SequenceTooLongError, match="sequence 1 would reach 17 tokens; max_seq_len"):
        c.check(step((1, range(17), 0)))
    assert len(c) == 0 and c.cached(1) == 0
    c.check(step((1, range(16), 0)))  # exactly full is fine; token ids unchecked without a vocab


def test_slots_go_lowest_first_in_step_order_and_come_back_on_release():
    c = SequenceCache(3, 16)
    s = step((5, [1], 0), (9, [1], 0))
    assert c.check(s) == [0, 1] and len(c) == 0  # planned, not taken
    c.advance(s)
    c.advance_rows([4], [0], [2])
    assert [c.slots.slot(i) for i in (5, 9, 4)] == [0, 1, 2]
    with pytest.raises(SequenceError, match="1 new sequences but only 0 free KV cache slots"):
        c.check(step((6, [1], 0)))
    c.release([9, 123])  # an unknown id is ignored
    assert c.check(step((6, [1], 0), (5, [2], 1))) == [1, 0] and c.cached(9) == 0
    c.clear()
    assert len(c) == 0 and c.slots._free == [0, 1, 2]
