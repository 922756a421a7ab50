"""The probe every rank runs as its TP group forms (`tandem.engine.tp.probe`): each rank's decode
GEMV speed and free memory, the group's all-reduce latency and goodput, gathered on every rank;
and the TP weights `--tp-weights auto` takes from it, and which weights a group forms with when
none are given (`choose_weights`)."""

import pytest

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.tp.probe import (
    FIELDS,
    RankKind,
    RankProbe,
    auto_weights,
    choose_weights,
    measure,
)


def test_every_rank_holds_every_ranks_probe_with_positive_figures():
    seen = run_ranks(ReferenceCommunicator.group(3), lambda c: measure(c, "cpu", "float32"))
    for probes in seen:
        assert [p.rank for p in probes] == [0, 1, 2]
        assert probes == seen[0]  # the same rows on every rank
        for p in probes:
            assert all(v > 0 for v in p.as_dict().values()), p
            assert set(p.as_dict()) == set(FIELDS)


def test_auto_weights_are_proportional_to_the_measured_gemv_speed():
    probes = [RankProbe(0, 20.0, 8.0, 0.1, 900.0), RankProbe(1, 10.0, 4.0, 0.1, 900.0)]
    assert auto_weights(probes) == (2.0, 1.0)
    assert auto_weights(probes[::-1]) == (1.0, 2.0)


ALIKE = RankKind("cpu", "float32", "box", 1, 0.0)


def _probes(*gemv):
    return [RankProbe(r, g, 8.0, 0.1, 900.0) for r, g in enumerate(gemv)]


def test_alike_ranks_keep_the_equal_split_whatever_the_probe_read():
    choice = choose_weights(None, _probes(10.0, 3.0), [ALIKE, ALIKE])
    assert (choice.weights, choice.how) == ((1.0, 1.0), "equal")
    assert "alike ranks" in choice.line() and "TP weights 1 : 1" in choice.line()


@pytest.mark.parametrize(
    "other, named",
    [
        (RankKind("cuda", "float32", "box", 1, 0.0), "device cpu/cuda"),
        (RankKind("cpu", "bfloat16", "box", 1, 0.0), "dtype float32/bfloat16"),
        (RankKind("cpu", "float32", "other", 1, 0.0), "host box/other"),
        (RankKind("cpu", "float32", "box", 2, 0.0), "threads 1/2"),
        (RankKind("cpu", "float32", "box", 1, 0.5), "cpu_quota 0.0/0.5"),
    ],
)
def test_ranks_that_differ_in_a_fact_are_split_by_the_probe(other, named):
    choice = choose_weights(None, _probes(12.0, 10.0), [ALIKE, other])
    assert choice.how == "auto" and choice.weights == (1.2, 1.0)
    assert named in choice.why


def test_given_and_auto_weights_are_taken_as_asked():
    given = choose_weights((2.0, 1.0), _probes(1.0, 1.0), [ALIKE, ALIKE])
    assert (given.weights, given.how) == ((2.0, 1.0), "given")
    auto = choose_weights("auto", _probes(9.0, 10.0), [ALIKE, ALIKE])
    assert (auto.weights, auto.how) == ((1.0, 1.111), "auto")
