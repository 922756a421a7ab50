"""The numerical conformance check at join (`tandem.engine.tp.conformance`), in process: honest
float32, bfloat16 and float16 ranks pass against the head's float64 reference from the file; a
rank whose kernel is wrong is refused on every rank, by name."""

import pytest
import torch
from tp_support import tiny_config, write_random_model

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.tp.conformance import ConformanceError, check_conformance, tolerance
from tandem.loaders.safetensors_dir import ModelDir
from tandem.parallel.plan import plan_for_config
from tandem.parallel.shard_load import load_shard
from tandem.parallel.transform import shard_transformer

CONFIG = tiny_config(intermediate_size=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("conformance"), CONFIG)


def _group(model_dir, dtypes, weights=None, wrong=None):
    """Every rank loads its shard in its dtype and runs the check; `wrong(rank, mlp)` may break a
    rank's kernel first (the test's fault, injected here and nowhere in the product)."""
    n = len(dtypes)
    plan = plan_for_config(CONFIG, n, weights)

    def body(comm):
        md = ModelDir(model_dir)
        dtype = getattr(torch, dtypes[comm.rank])
        model = shard_transformer(CONFIG, plan, comm, dtype=dtype).eval()
        load_shard(model, md, plan, comm.rank)
        if wrong is not None:
            wrong(comm.rank, model.model.layers["0"].mlp)
        return check_conformance(
            comm,
            model,
            md=md if comm.rank == 0 else None,
            plan=plan if comm.rank == 0 else None,
            dtypes=dtypes,
            devices=["cpu"] * n,
        )

    return run_ranks(ReferenceCommunicator.group(n), body)


@pytest.mark.parametrize(
    "dtypes,weights",
    [
        (["float32", "float32"], None),
        (["float32", "bfloat16", "float16"], None),
        (["bfloat16", "float16"], (2.0, 1.0)),
    ],
)
def test_honest_ranks_of_every_dtype_pass_within_their_tolerance(model_dir, dtypes, weights):
    verdicts = _group(model_dir, dtypes, weights)
    for seen in verdicts:  # every rank holds the head's verdict
        assert [v.rank for v in seen] == list(range(len(dtypes)))
        assert all(v.ok for v in seen), seen
    for v, dt in zip(verdicts[0], dtypes):
        # K: the longest contraction, hidden (64) or the rank's MLP rows (at most 256)
        assert tolerance(dt, 64, False) <= v.tolerance * (1 + 1e-6)
        assert v.tolerance <= tolerance(dt, 256, False) * (1 + 1e-6)
        assert v.error <= v.tolerance / 2  # honest ranks sit well inside the bound
        if dt == "float32":
            assert v.error < 1e-5


def _scale_gate(rank_to_break, factor):
    def wrong(rank, mlp):
        if rank != rank_to_break:
            return
        honest = mlp.gate_proj.forward
        mlp.gate_proj.forward = lambda x: honest(x) * factor

    return wrong


def test_a_rank_with_a_wrong_kernel_is_refused_on_every_rank_by_name(model_dir):
    with pytest.raises(ConformanceError) as e:
        _group(model_dir, ["float32", "bfloat16", "float32"], wrong=_scale_gate(1, 1.5))
    msg = str(e.value)
    assert "rank 1 (cpu, bfloat16)" in msg and "tolerance" in msg
    assert "rank 0" not in msg and "rank 2" not in msg


def test_a_small_float32_error_is_caught_that_bfloat16_would_excuse(model_dir):
    with pytest.raises(ConformanceError, match=r"rank 0 \(cpu, float32\)"):
        _group(model_dir, ["float32", "float32"], wrong=_scale_gate(0, 1.001))


def test_tolerance_grows_with_coarser_dtypes_and_quantized_activations():
    f32, bf16, f16 = (tolerance(d, 4096, False) for d in ("float32", "bfloat16", "float16"))
    assert f32 < f16 < bf16 < 0.05
    assert tolerance("float32", 4096, True) > 8 / 254
