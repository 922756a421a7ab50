"""What a mixture-of-experts TP group must show about the experts each rank loaded, checked across
processes (tests/distributed/test_moe_processes.py)."""

import pytest

from tandem.loaders.source import open_model

# the TP placements of a MoE group: layout -> (ranks, start_head keyword arguments)
LAYOUTS = {
    "tp2": (2, {}),
    "tp3": (3, {}),
    "tp2-weights-2:1": (2, {"weights": (2.0, 1.0)}),
    "experts2": (2, {"moe": "experts"}),
    "experts3": (3, {"moe": "experts"}),
}


def assert_each_rank_shows_the_experts_it_loaded(ex, model_dir, moe: str) -> None:
    """Each rank's `experts` entry (what /v1/cluster shows) against what its process loaded
    (`held_experts`, gathered from every rank's modules): the same groups of experts and rows of
    each; every expert's rows tile the width over the ranks (whole experts: on one rank); the
    bytes it holds are its loaded expert tensors' (float32 as stored; gpt-oss's biases, which
    the entry leaves out, aside); over the ranks the held bytes are the checkpoint's experts and
    the expected reads 2 / 8 of them."""
    md = open_model(model_dir)
    cfg, spec = md.config, md.config.moe
    x = [r["experts"] for r in ex.describe()["ranks"]]
    for e in x:
        loaded = e["loaded"]
        groups = e["expert_groups"]
        assert loaded["groups"] == [
            [g["experts"][0], g["experts"][1], g["rows"][1] - g["rows"][0]] for g in groups
        ]
        assert e["moe"] == moe and e["n_experts"] == sum(g[1] - g[0] for g in loaded["groups"])
        assert loaded["sparse_layers"] == sum(map(spec.is_sparse, range(cfg.num_hidden_layers)))
        if not spec.expert_bias:
            assert loaded["bytes"] == e["held_expert_bytes"]
    for k in range(spec.num_experts):  # every expert's rows tile its width over the ranks
        rows = [
            g["rows"]
            for e in x
            for g in e["expert_groups"]
            if g["experts"][0] <= k < g["experts"][1]
        ]
        assert rows[0][0] == 0 and rows[-1][1] == spec.intermediate_size
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        if moe == "experts":
            assert len(rows) == 1
    file = sum(
        md.info(f"model.layers.{i}.mlp.experts.{p}_proj.weight").nbytes
        for i in range(cfg.num_hidden_layers) if spec.is_sparse(i) for p in ("gate", "up", "down")
    )  # fmt: skip
    assert sum(e["held_expert_bytes"] for e in x) == file
    assert sum(e["active_bytes"]["experts"] for e in x) == pytest.approx(file * 2 / 8, abs=len(x))
