"""What executors say about themselves (`Executor.describe()`): shards, work shares, pids and hosts,
and the state, from the same facts the group formed with."""

import os
import socket

import pytest
from tp_support import tiny_config, write_random_model

from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.comm.solo import SoloCommunicator
from tandem.engine import cluster_info as ci
from tandem.engine.local import LocalExecutor
from tandem.engine.pp.layout import StageSpec
from tandem.engine.runner import ShardRunner
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.setup import RankInfo, _host_text, _host_words, exchange_rank_info, rank_facts
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import ModelDir
from tandem.parallel.partition import LayerRange
from tandem.parallel.plan import plan_for_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("ci") / "m", tiny_config(intermediate_size=512)
    )


def _tiles(ranges, total):
    """Contiguous, non-overlapping, complete: [0, a) [a, b) ... [., total)."""
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_tp_rank_facts_tile_heads_rows_and_vocab_and_shares_follow_the_weights(model_dir):
    md = ModelDir(model_dir)
    cfg = md.config
    plan = plan_for_config(cfg, 2, (3.0, 1.0))
    ranks = [RankInfo(0, "float32", "cpu", 2, 11, "a"), RankInfo(1, "bfloat16", "cpu", 1, 12, "b")]
    facts = rank_facts(md, plan, ranks, "cpu")
    shards = [f.shard for f in facts]
    _tiles([s["kv_heads"] for s in shards], cfg.num_key_value_heads)
    _tiles([s["q_heads"] for s in shards], cfg.num_attention_heads)
    _tiles([s["mlp_rows"] for s in shards], cfg.intermediate_size)
    _tiles([s["vocab_rows"] for s in shards], cfg.vocab_size)
    assert all(s["layers"] == [0, cfg.num_hidden_layers] for s in shards)
    assert sum(f.work_share for f in facts) == pytest.approx(1.0)
    assert facts[0].work_share > 2 * facts[1].work_share  # weights 3:1
    assert [(f.role, f.host, f.pid, f.dtype) for f in facts] == [
        ("head", "a", 11, "float32"),
        ("worker", "b", 12, "bfloat16"),
    ]
    assert facts[0].weight_format == "safetensors F32"
    assert [f.local for f in facts] == [True, False]  # only the head's memory is read here
    assert facts[1].entry()["rss_bytes"] is None


def test_pipeline_facts_cover_every_layer_once_and_the_head_holds_the_lm_head(model_dir):
    cfg = ModelDir(model_dir).config
    stages = [StageSpec(LayerRange(0, 1), tp=2), StageSpec(LayerRange(1, 2), tp=1, dtype="float16")]
    facts = ci.pipeline_facts(cfg, "safetensors F32", stages, [[0, 1], [2]], {0: os.getpid()}, {})
    assert [f.rank for f in facts] == [0, 1, 2]
    assert [f.role for f in facts] == ["head", "stage 0", "stage 1"]
    assert [f.shard["layers"] for f in facts] == [[0, 1], [0, 1], [1, 2]]
    _tiles([facts[0].shard["kv_heads"], facts[1].shard["kv_heads"]], cfg.num_key_value_heads)
    assert "vocab_rows" not in facts[0].shard  # a TP stage shards its layers only
    assert facts[2].shard == {"layers": [1, 2], "stage": 1, "n_stages": 2}
    assert facts[2].dtype == "float16"
    assert sum(f.work_share for f in facts) == pytest.approx(1.0)
    assert facts[0].work_share > facts[1].work_share  # the same layers, plus the LM head
    assert [f.local for f in facts] == [True, False, False]
    links = ci.pipeline_links([[0, 1], [2]])
    assert [(x["a"], x["b"], x["kind"]) for x in links] == [
        (0, 2, "stage"),
        (2, 0, "stage"),
        (0, 1, "ring"),
    ]


def test_rank_info_carries_each_ranks_pid_and_host_name():
    got = run_ranks(
        ReferenceCommunicator.group(2), lambda comm: exchange_rank_info(comm, "float32", "cpu")
    )
    assert got[0] == got[1]
    assert [(r.rank, r.pid, r.host) for r in got[0]] == [
        (0, os.getpid(), socket.gethostname()),
        (1, os.getpid(), socket.gethostname()),
    ]
    for name in ("", "node-1.lab", "ünïcode-host", "x" * 64):
        assert _host_text(_host_words(name)) == name
    assert _host_text(_host_words("y" * 80)) == "y" * 64  # cut to HOST_BYTES


def test_local_executor_describes_one_rank_holding_every_layer(model_dir):
    md = ModelDir(model_dir)
    ex = LocalExecutor(load_model(md), weight_format=md.weight_format(), kernels="torch")
    d = ex.describe()
    assert d["layout"] == {"kind": "single", "tp": 1, "pp": 1, "world_size": 1}
    assert d["state"] == "whole" and d["links"] == []
    (r,) = d["ranks"]
    assert r["shard"]["layers"] == [0, md.config.num_hidden_layers] and r["work_share"] == 1.0
    assert r["pid"] == os.getpid() and r["rss_bytes"] > 0
    assert r["weight_format"] == "safetensors F32"


class _ExitedWorkers:
    def __init__(self):
        self.gone = None

    def exited(self):
        return self.gone


def test_tp_executor_turns_failed_as_soon_as_a_local_worker_has_exited(model_dir):
    model = load_model(ModelDir(model_dir))
    ex = TPExecutor(ShardRunner(model, 2, 32), SoloCommunicator(), model.config.vocab_size)
    workers = ex.local_workers = _ExitedWorkers()
    assert ex.describe()["state"] == "whole" and ex.health() == (True, "all 1 ranks are up")
    workers.gone = ("rank1", -9)
    d = ex.describe()
    assert d["state"] == "failed" and d["detail"] == "worker rank1 exited with code -9 (SIGKILL)"
    assert ex.health() == (False, "worker rank1 exited with code -9 (SIGKILL)")


def test_a_description_refuses_a_state_outside_the_four():
    facts = ci.RankFacts(0, "head", "h", "cpu", "float32", None, ci.layer_shard((0, 1)))
    with pytest.raises(ValueError, match="not one of"):
        ci.Description("single", 1, 1, [facts], state="half").as_dict()


def test_join_rtts_keep_only_measured_figures_of_real_ranks():
    from tandem.engine.build import join_rtts

    text = '{"1": 0.42, "2": 3, "0": 1.0, "5": 1.0, "x": 2.0, "3": "fast", "4": true}'
    assert join_rtts(text, 5) == {1: 0.42, 2: 3.0}
    for bad in ("", "[1, 2]", "{", '{"1": NaN}', '{"1": -1}'):
        assert join_rtts(bad, 5) == {}, bad


class _Proc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


def test_pipeline_head_turns_failed_as_soon_as_a_stage_process_has_exited(model_dir):
    from tandem.engine.pp.head import PipelineExecutor

    model = load_model(ModelDir(model_dir))
    ex = PipelineExecutor(
        model, None, to_next=[], from_last=None, num_stages=2, max_batch=2, max_seq_len=32
    )
    ex.grid, ex.worker_procs = [[0], [1]], [_Proc()]
    d = ex.describe()
    assert d["state"] == "whole" and ex.health()[0]
    assert d["layout"] == {"kind": "pp", "tp": 1, "pp": 2, "world_size": 2}
    assert [(x["a"], x["b"]) for x in d["links"]] == [(0, 1), (1, 0)]
    ex.worker_procs[0].code = -9
    assert ex.describe()["state"] == "failed"
    assert ex.health() == (
        False,
        "1 stage process(es) exited, the first with code -9 (SIGKILL)",
    )


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tandem.loaders.make import make_model_dir

    d = tmp_path_factory.mktemp("moe") / "m"
    make_model_dir(d, "tiny-qwen3-moe")
    return d


def _expert_bytes(md, layers) -> int:
    return sum(
        md.info(f"model.layers.{i}.mlp.experts.{p}_proj.weight").nbytes
        for i in layers
        for p in ("gate", "up", "down")
    )


def test_a_moe_ranks_entry_shows_its_experts_and_bytes_single_node_and_in_a_grid(moe_dir):
    """tiny-qwen3-moe (8 experts of 64 rows, 2 active; layer 1 dense) in float32: one node holds
    every expert of layers 0 and 2 and reads 2 / 8 of them per token; a (TP=2 on layers [0, 2),
    one rank on [2, 3)) grid's TP ranks hold rows [0, 32) and [32, 64) of layer 0's experts
    (layer 1 is dense) and the last stage all of layer 2's; dense models carry no entry."""
    md = ModelDir(moe_dir)
    one = LocalExecutor.from_dir(moe_dir).describe()["ranks"][0]["experts"]
    assert one["experts"] == [0, 8] and one["moe"] == "tp"
    assert one["expert_groups"] == [{"experts": [0, 8], "rows": [0, 64]}]
    assert one["held_expert_bytes"] == _expert_bytes(md, (0, 2))
    assert one["active_bytes"]["experts"] == _expert_bytes(md, (0, 2)) * 2 / 8
    assert one["active_bytes"]["dense_mlp"] == sum(
        md.info(f"model.layers.1.mlp.{p}_proj.weight").nbytes for p in ("gate", "up", "down")
    )
    stages = [StageSpec(LayerRange(0, 2), tp=2), StageSpec(LayerRange(2, 3), tp=1)]
    facts = ci.pipeline_facts(md.config, "safetensors F32", stages, [[0, 1], [2]], {}, {}, md)
    x = [f.entry()["experts"] for f in facts]
    assert [[g["rows"] for g in e["expert_groups"]] for e in x] == [
        [[0, 32]],
        [[32, 64]],
        [[0, 64]],
    ]
    assert x[0]["held_expert_bytes"] + x[1]["held_expert_bytes"] == _expert_bytes(md, (0,))
    assert x[2]["held_expert_bytes"] == _expert_bytes(md, (2,))
    assert x[2]["active_bytes"]["dense_mlp"] == 0  # the dense layer is stage 0's
    dense = ci.pipeline_facts(tiny_config(), None, [StageSpec(LayerRange(0, 2))], [[0]], {}, {})
    assert dense[0].entry()["experts"] is None


def test_the_torch_free_single_node_shows_a_moe_files_experts_at_its_block_types(tmp_path):
    """A Q8_0 tiny-qwen3-moe GGUF on the torch-free path: one rank holding the 8 experts of both
    sparse layers, their bytes the file's blocks (34 per 32 weights), 2 / 8 of them read."""
    from tandem.engine.lean import LeanExecutor
    from tandem.loaders.gguf.writer import write_preset_gguf
    from tandem.loaders.source import open_model

    file = write_preset_gguf(tmp_path / "m.gguf", "tiny-qwen3-moe", "Q8_0")[1][0]
    x = LeanExecutor.from_file(file, max_batch=1, max_seq_len=32).describe()["ranks"][0]["experts"]
    held = _expert_bytes(open_model(file), (0, 2))
    assert held == 2 * 3 * 8 * 64 * 64 * 34 // 32
    assert x["experts"] == [0, 8] and x["held_expert_bytes"] == held
    assert x["active_bytes"]["experts"] == held * 2 / 8


def test_a_moe_ranks_work_share_follows_the_experts_it_holds():
    """tiny-qwen3-moe (D 64; 4 q / 2 kv heads of 16; 8 experts of 64, 2 active; layer 1 dense,
    MLP 128) at 2:1 on whole experts: 5 and 3 experts, one kv head and 64 MLP rows each. Per
    layer a rank reads attention 64 (32 + 2 16 + 32) = 6144; a sparse layer adds the router
    8 64 = 512 and 2 n_r / 8 experts of 64 3 64 = 12 288 (rank 0: 15 360, rank 1: 9216); the
    dense layer its 64 rows, 12 288. Over the 3 layers: rank 0 (3 6144 + 2 (512 + 15 360) +
    12 288) / 3 = 20 821.3, rank 1 (18 432 + 2 (512 + 9216) + 12 288) / 3 = 16 725.3, where
    the dense formula gave both 18 432."""
    from tandem.models.presets import get_preset

    cfg = get_preset("tiny-qwen3-moe").config
    plan = plan_for_config(cfg, 2, (2.0, 1.0), moe="experts")
    assert ci.layer_work(cfg, plan, 0) == pytest.approx(62_464 / 3, rel=1e-12)
    assert ci.layer_work(cfg, plan, 1) == pytest.approx(50_176 / 3, rel=1e-12)
