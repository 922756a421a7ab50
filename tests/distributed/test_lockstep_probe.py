"""The lockstep probe runs real ranks joined by the TCP ring on loopback and reports its figures."""

from types import SimpleNamespace

import pytest

from tandem.bench.lockstep import LockstepProbeError, measure_lockstep, segment_cols

TINY = SimpleNamespace(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=128, num_hidden_layers=2, tie_word_embeddings=True,
)  # fmt: skip


def test_probe_times_k_ring_ranks_and_the_segment_alone():
    probe = measure_lockstep(TINY, ks=(2,), blocks=2, pool_mb=1, timeout_s=120)
    assert probe["hidden"] == 64 and probe["block"] == 2 * 2 + 3
    f = probe["by_k"]["2"]
    assert f["cols"] == segment_cols(TINY, 2)
    assert f["alone_s"] > 0 and f["free_s"] > 0 and 1.0 <= f["slots"] <= 2.0
    # every iteration waits for the all-reduce, so lockstep is never faster than the segment alone
    assert f["lockstep_s"] > f["alone_s"]


def test_probe_refuses_degrees_below_two():
    with pytest.raises(LockstepProbeError):
        measure_lockstep(TINY, ks=(1,))
