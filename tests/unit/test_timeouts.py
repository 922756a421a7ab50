"""Timeouts are what they say: 0, negative, NaN or infinite op and handshake timeouts are refused
with a typed error naming the field (never silently read as the 60 s default), wherever they come
from, and the keepalive follows the op timeout so an idle group always pings inside it."""

from __future__ import annotations

import math

import pytest

from tandem.cluster.ring_config import (
    KEEPALIVE_MAX_S,
    TimeoutValueError,
    keepalive_interval,
    parse_ring_config,
)
from tandem.comm.ring import RingCommunicator
from tandem.comm.star import StarCommunicator

GOOD = {"port": 9000, "right_ip": "127.0.0.1", "right_port": 9001, "rank": 0, "world_size": 2}


@pytest.mark.parametrize("field", ["op_timeout", "handshake_timeout"])
@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5])
def test_a_zero_or_negative_timeout_in_ring_config_is_refused_naming_the_field(field, value):
    with pytest.raises(TimeoutValueError, match=f"field '{field}' must be a finite number"):
        parse_ring_config({**GOOD, field: value})


def test_absent_timeouts_take_the_defaults_and_given_ones_are_kept():
    cfg = parse_ring_config(GOOD)
    assert (cfg.op_timeout, cfg.handshake_timeout) == (60.0, 120.0)
    cfg = parse_ring_config({**GOOD, "op_timeout": 0.25, "handshake_timeout": 7})
    assert (cfg.op_timeout, cfg.handshake_timeout) == (0.25, 7.0)


@pytest.mark.parametrize("value", [0.0, -3.0, math.nan, math.inf])
def test_communicators_refuse_a_timeout_that_is_not_positive_and_finite(value):
    with pytest.raises(TimeoutValueError, match="op_timeout"):
        RingCommunicator.create(
            0, 2, right=("127.0.0.1", 1), listen=("127.0.0.1", 0), op_timeout=value
        )
    with pytest.raises(TimeoutValueError, match="handshake_timeout"):
        StarCommunicator.create(1, 2, root=("127.0.0.1", 1), handshake_timeout=value)


def test_the_keepalive_is_a_quarter_of_the_op_timeout_capped_at_5_s():
    assert keepalive_interval(2.0) == 0.5 and keepalive_interval(0.4) == 0.1
    assert keepalive_interval(60.0) == KEEPALIVE_MAX_S == 5.0
    for op in (0.1, 1.0, 3.0, 19.9, 600.0):
        assert keepalive_interval(op) < op / 2  # at least two pings inside each op timeout
    with pytest.raises(TimeoutValueError):
        keepalive_interval(0.0)
