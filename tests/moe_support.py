"""What a mixture-of-experts TP group must show about the experts each rank loaded, checked in
process (tests/unit/test_moe_placements_in_process.py) and across processes
(tests/distributed/test_moe_processes.py)."""

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
    (`held_experts`, gathered from every rank's modules): the same experts and rows of each;
    whole experts tile [0, 8), rows of every expert tile the width; the bytes it holds are its
    loaded expert tensors' (float32 as stored; gpt-oss's biases, which the entry leaves out,
    aside); over the ranks the held bytes are the checkpoint's experts and the expected reads
    2 / 8 of them."""
    md = open_model(model_dir)
    cfg, spec = md.config, md.config.moe
    x = [r["experts"] for r in ex.describe()["ranks"]]
    for e in x:
        loaded = e["loaded"]
        assert loaded["experts"] == e["experts"] and e["moe"] == moe
        assert loaded["rows"] == e["expert_rows"][1] - e["expert_rows"][0]
        assert loaded["sparse_layers"] == sum(map(spec.is_sparse, range(cfg.num_hidden_layers)))
        if not spec.expert_bias:
            assert loaded["bytes"] == e["held_expert_bytes"]
    tiles = [e["experts"] if moe == "experts" else e["expert_rows"] for e in x]
    assert tiles[0][0] == 0 and all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    assert tiles[-1][1] == (spec.num_experts if moe == "experts" else spec.intermediate_size)
    file = sum(
        md.info(f"model.layers.{i}.mlp.experts.{p}_proj.weight").nbytes
        for i in range(cfg.num_hidden_layers) if spec.is_sparse(i) for p in ("gate", "up", "down")
    )  # fmt: skip
    assert sum(e["held_expert_bytes"] for e in x) == file
    assert sum(e["active_bytes"]["experts"] for e in x) == pytest.approx(file * 2 / 8, abs=len(x))
