"""Every expert placement of a TP group (rows of every expert at TP=2, TP=3 and weights 2:1; whole
experts at 2 and 3 ranks) of Qwen3-MoE (a dense layer among sparse ones), Mixtral and gpt-oss
(biased clamped experts, sinks, sliding-window layers) equals single node in float32: greedy ids
for 32 tokens at batch 1 and 3, first logits within 1e-4, and each rank's experts and rows in the
cluster view are the ones it loaded. The ranks run the group's own setup (`tp.setup.start_head` /
`run_worker`: probe, layout agreement, shard load, admission) on threads over the reference
communicator; the same placements across real processes run on Qwen2-MoE
(tests/distributed/test_moe_processes.py)."""

import pytest
from family_greedy import assert_single_node, expected_greedy
from moe_support import LAYOUTS, assert_each_rank_shows_the_experts_it_loaded
from tp_support import SingleNode

import tandem.engine.tp.setup as tp_setup
from tandem.comm.metered import MeteredCommunicator
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.loaders.make import make_model_dir

# the ranks are threads of this process: one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.ranks_in_process


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"])
def family(request, tmp_path_factory):
    """(model dir, single-node greedy at batch 1 and 3)."""
    d = tmp_path_factory.mktemp(request.param) / "m"
    make_model_dir(d, request.param)
    return d, expected_greedy(SingleNode(d))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_expert_placement_matches_single_node_in_process(family, layout):
    model_dir, expected = family
    tp, kw = LAYOUTS[layout]
    moe = kw.get("moe", "tp")

    def rank(comm):
        if comm.rank != 0:
            return tp_setup.run_worker(model_dir, comm, dtype="float32", device="cpu")
        ex = tp_setup.start_head(
            model_dir, MeteredCommunicator(comm), max_batch=4, max_seq_len=128, **kw
        )
        try:
            assert ex.layout.moe == moe
            assert_single_node(ex, expected)
            shards = [r["shard"] for r in ex.describe()["ranks"]]
            assert all(s["moe"] == moe for s in shards)
            if moe == "experts":  # whole experts, tiling [0, 8) in rank order
                assert [s["experts"][0] for s in shards] == sorted(s["experts"][0] for s in shards)
                assert shards[0]["experts"][0] == 0 and shards[-1]["experts"][1] == 8
            assert_each_rank_shows_the_experts_it_loaded(ex, model_dir, moe)
        finally:
            ex.close()

    run_ranks(ReferenceCommunicator.group(tp), rank)
