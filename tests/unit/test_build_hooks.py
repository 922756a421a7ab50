"""`build_executor` with what the caller already holds: a formed TP group (the bench's traced
ring; run end to end by `tests/e2e/test_bench_decode_run.py`) and where a pipeline's ranks run
(the bench's emulated hosts)."""

import pytest
from tp_support import tiny_config, write_random_model

from tandem.engine.build import BuildHooks, Layout, LayoutUnavailable, Limits, build_executor
from tandem.engine.pp import launch


class _Rank1:
    rank, world_size, closed = 1, 2, False

    def close(self):
        self.closed = True


def test_a_formed_group_where_this_process_is_not_rank_0_is_refused(tmp_path):
    comm = _Rank1()
    with pytest.raises(LayoutUnavailable, match="the given group is rank 1: only rank 0"):
        build_executor(tmp_path, Layout(stage_tp=(2,)), Limits(), BuildHooks(comm=comm))
    assert comm.closed


def test_a_pipelines_addresses_and_command_prefix_reach_its_launcher(tmp_path, monkeypatch):
    d = write_random_model(tmp_path / "m", tiny_config())
    seen = {}
    monkeypatch.setattr(launch, "launch_pipeline", lambda model, stages, **kw: seen.update(kw))
    prefix = lambda g: ["ip", "netns", "exec", f"h{g}"]  # noqa: E731
    hooks = BuildHooks(addresses=("10.0.0.1", "10.0.0.2"), argv_prefix=prefix)
    build_executor(d, Layout(stage_tp=(1, 1)), Limits(2, 32), hooks)
    assert seen["addresses"] == ("10.0.0.1", "10.0.0.2") and seen["argv_prefix"] is prefix
    assert (seen["max_batch"], seen["max_seq_len"]) == (2, 32)
