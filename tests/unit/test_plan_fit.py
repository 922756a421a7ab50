"""A TP plan that does not fit a rank's memory is refused before any shard is loaded, on every rank,
naming the rank and the bytes (`tandem.parallel.fit`, checked in `engine.tp.setup`)."""

import pytest
from model_shapes import qwen3_30b_a3b
from tp_support import tiny_config, write_random_model

import tandem.engine.tp.placement as tp_placement
import tandem.engine.tp.setup as tp_setup
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.parallel.fit import (
    HEADROOM_BYTES,
    PlanDoesNotFitError,
    check_fit,
    moe_ffn_elements,
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


# ---- mixture of experts: each rank holds the experts (and rows of them) its placement gives it ----


def _held_elements(config, plan, rank):
    """Elements of every matrix of `rank`'s shard as the TP transform builds it (on the meta
    device): what `rank_needs` counts, norms and biases left out."""
    from tandem.comm.reference import ReferenceCommunicator
    from tandem.parallel.transform import shard_transformer

    comm = ReferenceCommunicator.group(plan.world_size)[rank]
    model = shard_transformer(config, plan, comm, device="meta")
    held = model.named_parameters()
    return sum(p.numel() for n, p in held if n.endswith("weight") and p.dim() >= 2)


@pytest.mark.parametrize(
    "preset", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-gpt-oss"]
)
@pytest.mark.parametrize(
    ("world", "weights", "moe"),
    [(2, None, "tp"), (2, None, "experts"), (3, (3.0, 2.0, 1.0), "experts"), (2, (2.0, 1.0), "tp")],
)
def test_a_moe_ranks_weights_are_the_matrices_its_shard_holds(preset, world, weights, moe):
    """Router on every rank, the placement's experts and rows of them, dense layers among sparse
    ones at their MLP rows: `rank_needs` equals the element count of the shard the transform
    builds, for every rank, under both placements (gpt-oss's expert biases, E (2 w + D) a layer,
    are left out with the other biases)."""
    from tandem.models.presets import PRESETS

    config = PRESETS[preset].config
    plan = plan_for_config(config, world, weights, moe=moe)
    needs = rank_needs(
        config,
        plan,
        elem_bytes=[4] * world,
        weight_bytes_per_elem=[1] * world,
        free_bytes=[1 << 30] * world,
        max_batch=1,
        max_seq_len=16,
    )
    assert [n.weight_bytes for n in needs] == [
        _held_elements(config, plan, r) for r in range(world)
    ]


def test_tiny_qwen3_moe_at_tp2_counts_experts_router_and_its_dense_layer():
    """tiny-qwen3-moe: D 64, 3 layers (layer 1 dense, MLP 128), 4 q / 2 kv heads of 16, 8 experts
    of width 64, vocabulary 512 tied. Rank r of TP=2 (either placement) holds per layer attention
    64 16 (2 2 + 2 1) = 6 144; per sparse layer the router 8 64 = 512 and 8 experts x 32 rows
    (or 4 whole experts) x 3 x 64 = 49 152; the dense layer 3 64 64 = 12 288; half the vocabulary
    64 256 = 16 384: 3 6 144 + 2 (512 + 49 152) + 12 288 + 16 384 = 146 432 elements. The dense
    formula (every layer an MLP of 128 rows) gave 71 680: half of what the rank holds."""
    from tandem.models.presets import PRESETS

    config = PRESETS["tiny-qwen3-moe"].config
    for moe in ("tp", "experts"):
        plan = plan_for_config(config, 2, moe=moe)
        assert moe_ffn_elements(config, plan, 0) == 512 + 49_152
        (n0, n1) = rank_needs(
            config, plan, elem_bytes=[4, 4], weight_bytes_per_elem=[1, 1],
            free_bytes=[0, 0], max_batch=1, max_seq_len=16,
        )  # fmt: skip
        assert n0.weight_bytes == n1.weight_bytes == 146_432


def test_qwen3_30b_a3b_at_tp2_is_refused_on_16_gb_and_admitted_on_32_gb():
    """Qwen3-30B-A3B in bfloat16 at TP=2, either placement: a rank holds per layer attention
    2048 128 (2 16 + 2 2) = 9 437 184, the router 128 2048 = 262 144 and 128 experts x 384 rows
    (or 64 whole experts) x 3 x 2048 = 301 989 888; half of the two vocabulary matrices,
    2 2048 75 968 = 311 164 928: 48 (9 437 184 + 262 144 + 301 989 888) + 311 164 928 =
    15 272 247 296 elements, 30.54 GB. The dense formula (an MLP of 3072 rows per rank) said
    3.34 GB and admitted the plan on two 16 GB ranks; it is refused there now and fits two 32 GB
    ones. In Q4_K (144 bytes per 256 elements) the same rank needs 8.59 GB: two 10 GB ranks."""
    config = qwen3_30b_a3b()
    kw = dict(elem_bytes=[2, 2], max_batch=1, max_seq_len=4096)
    kv = 2 * 48 * 4096 * 2 * 128 * 2  # K and V, layers, positions, 2 kv heads, hd, bfloat16
    for moe in ("tp", "experts"):
        plan = plan_for_config(config, 2, moe=moe)
        assert moe_ffn_elements(config, plan, 1) == 262_144 + 301_989_888
        needs = rank_needs(
            config, plan, weight_bytes_per_elem=[2, 2], free_bytes=[16 * 10**9] * 2, **kw
        )
        assert [n.weight_bytes for n in needs] == [2 * 15_272_247_296] * 2
        assert [n.kv_bytes for n in needs] == [kv] * 2
        with pytest.raises(PlanDoesNotFitError):
            check_fit(needs)
        check_fit(
            rank_needs(
                config, plan, weight_bytes_per_elem=[2, 2], free_bytes=[32 * 10**9] * 2, **kw
            )
        )
        q4k = rank_needs(
            config, plan, weight_bytes_per_elem=[144 / 256] * 2, free_bytes=[10 * 10**9] * 2, **kw
        )
        assert q4k[0].weight_bytes == int(15_272_247_296 * 144 / 256)  # 8.59 GB
        check_fit(q4k)


def test_qwen3_30b_a3b_whole_experts_follow_the_weights():
    """`--moe experts` with weights 3:1: 96 and 32 of the 128 experts, so rank 0's sparse layer
    holds 262 144 + 96 3 2048 768 = 453 246 976 elements and rank 1's 262 144 + 32 3 2048 768 =
    151 257 088 (the router on both)."""
    config = qwen3_30b_a3b()
    plan = plan_for_config(config, 2, (3.0, 1.0), moe="experts")
    assert [plan.n_held_experts(r) for r in range(2)] == [96, 32]
    assert moe_ffn_elements(config, plan, 0) == 453_246_976
    assert moe_ffn_elements(config, plan, 1) == 151_257_088
