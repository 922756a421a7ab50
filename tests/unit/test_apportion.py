import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.parallel.apportion import Span, apportion, spans
from tandem.parallel.partition import LayerRange
from tandem.parallel.partition import split_by_weights as split_layers
from tandem.parallel.plan import split_by_weights as split_dimension


@pytest.mark.parametrize(
    "units, weights, counts",
    [
        (8, (1, 1, 1), (3, 3, 2)),
        (10, (1, 1, 1), (4, 3, 3)),
        (7, (1,), (7,)),
        (9, (2, 1), (6, 3)),
        (8, (2, 1), (5, 3)),
        (28, (2.0, 1.0), (19, 9)),
        (10, (1, 2, 1), (3, 5, 2)),
        (48, (2, 1), (32, 16)),
        (2, (10, 1), (2, 0)),
        (2, (1, 1, 1), (1, 1, 0)),
        (4, (100.0, 1.0), (4, 0)),
        (5, (1, 1, 1, 1), (2, 1, 1, 1)),
        (2374, (2.5, 1), (1696, 678)),
        (17, (1, 9, 2), (1, 13, 3)),
    ],
)
def test_apportion_is_largest_remainder_with_ties_to_the_lower_index(units, weights, counts):
    assert apportion(units, weights) == counts


def test_spans_tile_from_zero_in_blocks_of_scale():
    assert spans((3, 3, 2)) == (Span(0, 3), Span(3, 6), Span(6, 8))
    assert spans((2, 1), 64) == (Span(0, 128), Span(128, 192))
    assert spans((1, 0, 2)) == (Span(0, 1), Span(1, 1), Span(1, 3))


def test_span_is_half_open():
    s = Span(3, 7)
    assert len(s) == s.size == 4
    assert list(s) == [3, 4, 5, 6]
    assert str(s) == "[3, 7)"
    assert Span(0, 2) < Span(2, 4)
    assert LayerRange is Span


@given(
    units=st.integers(0, 5000),
    weights=st.lists(st.floats(0.01, 100.0, allow_nan=False), min_size=1, max_size=8),
)
def test_apportion_sums_to_units_and_each_count_is_floor_or_ceil_of_its_quota(units, weights):
    counts = apportion(units, weights)
    assert sum(counts) == units
    for n, w in zip(counts, weights):
        quota = units * w / sum(weights)
        assert math.floor(quota) <= n <= math.floor(quota) + 1


def test_the_tp_and_pp_splits_give_the_same_cut_for_the_same_weights():
    tp = split_dimension(28, (2.0, 1.0, 1.5))
    pp = split_layers(28, (2.0, 1.0, 1.5))
    assert tp == pp == (Span(0, 13), Span(13, 19), Span(19, 28))
