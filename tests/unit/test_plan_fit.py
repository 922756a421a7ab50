"""A TP plan that does not fit a rank's memory is refused before any shard is loaded, on every rank,
naming the rank and the bytes (`tandem.parallel.fit`, checked in `engine.tp.setup`)."""

import pytest
from tp_support import tiny_config, write_random_model

import tandem.engine.tp.placement as tp_placement
import tandem.engine.tp.setup as tp_setup
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.parallel.fit import (
    HEADROOM_BYTES,
    PlanDoesNotFitError,
    check_fit,
    rank_needs,
    share_host_memory,
)
from tandem.parallel.plan import DegeneratePlanError, plan_for_config, plan_for_source

CONFIG = tiny_config()  # D 64, hd 16, 2 layers, 8 q / 4 kv heads, 128 MLP rows, vocab 96, tied


def test_each_ranks_bytes_are_its_shard_and_its_kv_cache_at_the_configured_context():
    plan = plan_for_config(CONFIG, 2, (2.0, 1.0))  # kv heads 3 / 1, MLP rows 64 / 64
    needs = rank_needs(
        CONFIG,
        plan,
        elem_bytes=[4, 2],
        weight_bytes_per_elem=[4, 2],
        free_bytes=[1 << 30, 1 << 30],
        max_batch=2,
        max_seq_len=32,
    )
    for n, e in zip(needs, (4, 2)):
        q, kv = plan.q_heads(n.rank).size, plan.kv_heads[n.rank].size
        m, v = plan.intermediate[n.rank].size, plan.vocab[n.rank].size
        weights = 2 * (64 * 16 * (2 * q + 2 * kv) + 3 * 64 * m) + 64 * v  # tied: one vocab matrix
        assert n.weight_bytes == weights * e
        assert n.kv_bytes == 2 * 2 * 2 * 32 * kv * 16 * e  # K and V, layers, batch, seq, heads, hd
        assert n.need_bytes == n.weight_bytes + n.kv_bytes + HEADROOM_BYTES
    assert needs[0].kv_bytes == 3 * needs[1].kv_bytes * 2  # 3x the heads, 2x the element size


def test_a_rank_short_of_memory_is_named_with_its_bytes():
    plan = plan_for_config(CONFIG, 2)
    kw = dict(elem_bytes=[4, 4], weight_bytes_per_elem=[4, 4], max_batch=1, max_seq_len=16)
    check_fit(rank_needs(CONFIG, plan, free_bytes=[1 << 30, 1 << 30], **kw))  # fits: no error
    needs = rank_needs(CONFIG, plan, free_bytes=[1 << 30, 1000], **kw)
    with pytest.raises(PlanDoesNotFitError) as e:
        check_fit(needs)
    msg = str(e.value)
    assert "rank 1 needs" in msg and "rank 0" not in msg
    assert f"{needs[1].need_bytes / 1e9:.3f} GB" in msg and "0.000 GB free" in msg


def test_a_group_refuses_the_plan_on_every_rank_before_any_shard_loads(tmp_path, monkeypatch):
    model_dir = write_random_model(tmp_path, CONFIG)
    loaded = []
    real = tp_setup.build_shard
    monkeypatch.setattr(tp_setup, "build_shard", lambda *a, **k: loaded.append(1) or real(*a, **k))

    def body(comm):
        try:
            if comm.rank == 0:
                tp_setup.start_head(model_dir, comm, max_batch=1, max_seq_len=16)
            else:
                tp_setup.run_worker(
                    model_dir, comm, dtype="float32", device="cpu", mem_limit_gb=1e-6
                )
        except PlanDoesNotFitError as e:
            return str(e)
        return None

    msgs = run_ranks(ReferenceCommunicator.group(2), body)
    assert all(m is not None and "rank 1 needs" in m and "rank 0" not in m for m in msgs), msgs
    assert msgs[0] == msgs[1]
    assert loaded == []


def test_ranks_of_one_host_share_its_ram_and_a_gpu_keeps_its_own():
    free = [8_000, 8_000, 3_000, 5_000, 6_000]
    hosts = ["a", "a", "a", None, "b"]  # three CPU ranks on host a, a GPU, a CPU rank on b
    assert share_host_memory(free, hosts) == [2_666, 2_666, 2_666, 5_000, 6_000]
    capped = share_host_memory([8_000, 1_000], ["a", "a"])  # rank 1 offers less (a limit)
    assert capped == [4_000, 1_000]


def test_a_quantized_file_counts_its_block_bytes_per_weight(tmp_path):
    from tandem.loaders.source import open_model

    model_dir = write_random_model(tmp_path, CONFIG)
    q8 = tp_placement.stored_bytes_per_elem(open_model(model_dir, quantize="q8_0"))
    assert q8 == pytest.approx(34 / 32)  # Q8_0: 32 int8 and one f16 scale per block
    q4 = tp_placement.stored_bytes_per_elem(open_model(model_dir, quantize="q4_0"))
    assert q4 == pytest.approx(18 / 32)


def test_an_auto_split_the_blocks_cannot_realize_is_tempered_toward_equal(tmp_path):
    from tandem.engine.tp.probe import WeightsChoice
    from tandem.loaders.source import open_model

    md = open_model(write_random_model(tmp_path, CONFIG))  # 10 : 1 leaves rank 1 no block
    skewed = WeightsChoice((10.0, 1.0), "auto", "probed")
    got = tp_placement.plannable(md, 2, None, skewed)
    power = float(got.why.split("tempered to the power ")[1].split(":")[0])
    assert power in (0.75, 0.5, 0.25, 0.0)
    assert got.weights == pytest.approx((10.0**power, 1.0), rel=1e-3)
    plan_for_source(md, 2, got.weights)  # forms
    with pytest.raises(DegeneratePlanError):  # and the step before it did not
        plan_for_source(md, 2, (10.0 ** (power + 0.25), 1.0))
    given = WeightsChoice((10.0, 1.0), "given", "--tp-weights")
    assert tp_placement.plannable(md, 2, None, given) is given  # the user's to change
