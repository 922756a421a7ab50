"""Heterogeneous ranks: rank 0 computes in bfloat16, rank 1 in float16, and the TP=2 group follows
single-node bfloat16's greedy ids up to the first float32 near-tie (`mixed_dtype_support`), on
every tiny preset and on a real-size random qwen3-0.6b (16-bit GEMMs of its real widths). The
ranks run the group's own setup (`tp.setup.start_head` / `run_worker`: the probe that splits them
by dtype, the decode at join, each rank's shard in its own dtype) on threads over the reference
communicator; the same group across real processes, on two of the tiny presets:
tests/distributed/test_tp_mixed_dtype.py."""

import pytest
from mixed_dtype_support import MIN_COVERED, compare_to_single_node_bf16

import tandem.engine.tp.setup as tp_setup
from tandem.comm.metered import MeteredCommunicator
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.loaders.make import make_model_dir
from tandem.models.presets import PRESETS

TINY = sorted(p for p in PRESETS if p.startswith("tiny-"))


# the ranks are threads of this process: one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.ranks_in_process


def _bf16_head_f16_worker(model_dir, record_property, timeout=120.0, **compare) -> None:
    """A TP=2 group of a bfloat16 head and a float16 worker on two threads, compared; the worker
    waits in its next collective while the head runs the single-node references: `timeout`
    bounds each wait and the whole run."""

    def rank(comm):
        if comm.rank != 0:
            return tp_setup.run_worker(model_dir, comm, dtype="float16", device="cpu")
        ex = tp_setup.start_head(
            model_dir, MeteredCommunicator(comm), max_batch=1, max_seq_len=64, dtype="bfloat16"
        )
        try:
            compare_to_single_node_bf16(model_dir, ex, record_property, **compare)
        finally:
            ex.close()

    run_ranks(ReferenceCommunicator.group(2, timeout=timeout), rank, timeout=timeout)


@pytest.mark.parametrize("preset", TINY)
def test_bf16_and_f16_ranks_follow_single_node_bf16_in_process(tmp_path, record_property, preset):
    model_dir = tmp_path / preset
    make_model_dir(model_dir, preset, seed=0)
    _bf16_head_f16_worker(model_dir, record_property)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 16-bit GEMMs are slow on CPUs without native bf16/f16
def test_bf16_and_f16_ranks_follow_single_node_bf16_on_qwen3_06b(tmp_path, record_property):
    model_dir = tmp_path / "qwen3-0.6b"
    make_model_dir(model_dir, "qwen3-0.6b", seed=0)
    compare = dict(n_new=MIN_COVERED, tries=4, high=4000)
    _bf16_head_f16_worker(model_dir, record_property, timeout=1100.0, **compare)
