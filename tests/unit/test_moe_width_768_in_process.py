"""A K-quant Qwen3-MoE file with Qwen3-30B-A3B's expert width 768 at TP=2, the group's own setup
(`tp.setup.start_head` / `run_worker`: probe, layout agreement, shard load, admission) on threads
over the reference communicator: the balanced split of its 3 superblocks an expert, each rank
half the expert bytes, equal to single node. Every placement of every MoE family across real
processes: tests/distributed/test_moe_processes.py (the same width-768 layout runs there too)."""

from dataclasses import replace

import pytest
import torch
from family_greedy import PROMPTS
from tp_support import greedy_steps

import tandem.engine.tp.setup as tp_setup
from tandem.comm.metered import MeteredCommunicator
from tandem.comm.reference import ReferenceCommunicator, run_ranks
from tandem.engine.local import LocalExecutor
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.parallel.apportion import Span
from tandem.parallel.expert_split import ExpertGroup
from tandem.parallel.plan import plan_for_source

# the ranks are threads of this process: one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.ranks_in_process


def test_width_768_k_quant_experts_are_balanced_at_tp2_and_match_single_node(tmp_path):
    """Qwen3-MoE in K-quants (Q4_K gate/up, Q5_K down_exps) with Qwen3-30B-A3B's expert width 768:
    3 superblocks of 256 an expert, dealt so that experts [0, 4) give rank 0 rows [0, 512) and
    experts [4, 8) give it [0, 256) (rank 1 the rest of each). Each rank loads half the file's
    expert bytes (within one 256-row block of every expert of a group of the even split: here
    exactly half), and the group's greedy ids and logits (within 2e-3: the reference quantized
    modules, only the partials' float32 order differs) equal single node's on the same file."""
    c = get_preset("tiny-qwen3-moe").config
    c = replace(
        c, hidden_size=256, num_attention_heads=8, head_dim=64, intermediate_size=512,
        moe=replace(c.moe, intermediate_size=768),
    )  # fmt: skip
    file = write_preset_gguf(tmp_path / "moe-768.gguf", "tiny-qwen3-moe", "K_MIX", config=c)[1][0]
    src = open_model(file)
    plan = plan_for_source(src, 2)

    def g(e0, e1, r0, r1):
        return ExpertGroup(Span(e0, e1), Span(r0, r1))

    assert plan.moe == "tp" and plan.expert_align == 256
    assert plan.expert_groups == (
        (g(0, 4, 0, 512), g(4, 8, 0, 256)),
        (g(0, 4, 512, 768), g(4, 8, 256, 768)),
    )
    sparse = [i for i in range(c.num_hidden_layers) if c.moe.is_sparse(i)]
    names = [f"model.layers.{i}.mlp.experts.{p}_proj.weight" for i in sparse for p in ("gate", "up", "down")]  # fmt: skip
    file_bytes = sum(src.info(n).nbytes for n in names)
    block = file_bytes // (8 * 3)  # one 256-row block of one expert, all sparse layers

    prompt = PROMPTS[0]
    single = LocalExecutor(load_model(src), max_batch=1, max_seq_len=128, kernels="torch")
    want = greedy_steps(single, prompt, 16)
    single.close()

    def rank(comm):
        if comm.rank != 0:
            return tp_setup.run_worker(file, comm, dtype="float32", device="cpu", kernels="torch")
        ex = tp_setup.start_head(
            file, MeteredCommunicator(comm), max_batch=1, max_seq_len=128, kernels="torch"
        )
        try:
            loaded = [r["experts"]["loaded"] for r in ex.describe()["ranks"]]
            got = greedy_steps(ex, prompt, 16)
        finally:
            ex.close()
        return loaded, got

    (loaded, got), _ = run_ranks(ReferenceCommunicator.group(2), rank)
    assert [x["groups"] for x in loaded] == [[[0, 4, 512], [4, 8, 256]], [[0, 4, 256], [4, 8, 512]]]
    held = [x["bytes"] for x in loaded]
    assert sum(held) == file_bytes
    assert all(abs(h - file_bytes / 2) <= block * len(x["groups"]) for h, x in zip(held, loaded))
    assert held[0] == held[1]
    for n, ((a, x), (b, y)) in enumerate(zip(want, got)):
        assert float((x - y).abs().max()) <= 2e-3, f"step {n}"
        top = torch.topk(x, 2).values
        if float(top[0] - top[1]) < 0.01:
            break  # a near-tie: the float32 order may pick either
        assert a == b, f"step {n}"
