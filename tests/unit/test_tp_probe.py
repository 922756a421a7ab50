"""The probe every rank runs as its TP group forms (`tandem.engine.tp.probe`): each rank's decode
GEMV speed and free memory, the group's all-reduce latency and goodput, gathered on every rank;
and the TP weights `--tp-weights auto` takes from it."""

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.tp.probe import FIELDS, RankProbe, auto_weights, measure


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
