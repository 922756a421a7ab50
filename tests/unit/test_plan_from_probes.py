"""`tandem plan --from-status FILE`: the layouts of a cluster's probed ranks ranked by predicted
tok/s, the chosen one first (`tandem.plan.probes`); and the probe cells `cluster status` shows
(`tandem.cli.cluster_probe`)."""

import json

import pytest

from tandem.cli.cluster_probe import probe_cells, probes_from_view, view_url
from tandem.cli.main import main
from tandem.models.presets import get_preset
from tandem.parallel.partition import model_cost
from tandem.plan.model import PlanModelError
from tandem.plan.probes import link_from_probes, nodes_from_probes, probe_rows

CONFIG = get_preset("qwen3-0.6b").config


def _row(rank, gemv, dtype="float32", free=8.0, ms=0.2, mbit=4000.0):
    probe = {"gemv_gb_s": gemv, "free_gb": free, "allreduce_ms": ms, "goodput_mbit_s": mbit}
    return {"rank": rank, "device": "cpu", "dtype": dtype, "probe": probe}


SNAP = {"world_size": 2, "ranks": [_row(1, 5.0, "bfloat16", ms=0.3, mbit=3000.0), _row(0, 10.0)]}


def test_each_rank_is_a_node_whose_time_is_the_model_bytes_in_its_dtype_over_its_gemv_speed():
    rows = probe_rows(SNAP)
    assert [r["rank"] for r in rows] == [0, 1]
    cost = model_cost(CONFIG)
    params = cost.num_layers * cost.layer_params + cost.head_compute_params
    fast, slow = nodes_from_probes(CONFIG, rows)
    assert fast.s_per_token == pytest.approx(params * 4 / 10e9)
    assert slow.s_per_token == pytest.approx(params * 2 / 5e9)  # half the bytes at half the speed
    link = link_from_probes(rows, 130e-6)  # the slowest round, the lowest goodput
    assert link.rtt_s == pytest.approx(0.3e-3) and link.goodput_bytes_per_s == pytest.approx(375e6)


def test_a_snapshot_without_probes_is_refused_with_the_reason():
    with pytest.raises(PlanModelError, match="no rank has a probe yet"):
        probe_rows({"ranks": [{"rank": 0, "device": "cpu"}]})
    with pytest.raises(PlanModelError, match="lacks"):
        probe_rows({"ranks": [{"rank": 0, "probe": {"gemv_gb_s": 1.0}}]})


def test_plan_from_status_prints_the_layouts_ranked_by_predicted_speed_the_pick_first(
    tmp_path, capsys
):
    path = tmp_path / "status.json"
    path.write_text(json.dumps(SNAP))
    assert main(["plan", "--preset", "qwen3-0.6b", "--from-status", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    speeds = [p["tok_per_s"] for p in doc["predictions"]]
    assert speeds == sorted(speeds, reverse=True) and doc["pick"] == doc["predictions"][0]["layout"]
    assert len(doc["nodes"]) == 2
    assert main(["plan", "--preset", "qwen3-0.6b", "--from-status", str(path)]) == 0
    text = capsys.readouterr().out
    assert "rank 1 (cpu bfloat16): GEMV 5.00 GB/s" in text and f"pick: {doc['pick']}" in text
    assert text.index("| " + doc["pick"] + " |") < text.index("pick:")


def test_plan_from_a_status_without_probes_fails_in_one_line(tmp_path, capsys):
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"ranks": [{"rank": 0}]}))
    assert main(["plan", "--preset", "qwen3-0.6b", "--from-status", str(path)]) == 2
    assert "no rank has a probe yet" in capsys.readouterr().err


def test_status_cells_show_the_probe_or_dashes_before_the_group_forms():
    assert probe_cells({}) == ("-", "-", "-", "-")
    assert probe_cells(_row(0, 12.345)) == ("12.35", "8.00", "0.200 ms", "4000 Mbit/s")
    view = {"ranks": [{"rank": 0, "probe": {"gemv_gb_s": 1.0}}, {"rank": 1}]}
    assert probes_from_view(view) == {0: {"gemv_gb_s": 1.0}}
    assert view_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/v1/cluster"


def test_plan_from_status_of_a_moe_model_places_its_experts_on_the_probed_ranks(tmp_path, capsys):
    """tiny-qwen3-moe on two probed ranks at 10 and 5 GB/s: under whole experts the pick's
    placement lists every rank of the pick, fastest first, their experts tiling the 8."""
    path = tmp_path / "status.json"
    path.write_text(json.dumps(SNAP))
    argv = ["plan", "--preset", "tiny-qwen3-moe", "--from-status", str(path), "--moe", "experts"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ranks = doc["experts"]["ranks"]
    pick = next(p for p in doc["predictions"] if p["layout"] == doc["pick"])
    assert len(ranks) == len(pick["tp_shares"]) * len(pick["stage_layers"])
    assert ranks[0]["experts"][0] == 0 and ranks[-1]["experts"][1] == 8
    assert all(a["experts"][1] == b["experts"][0] for a, b in zip(ranks, ranks[1:]))
    assert main(argv) == 0
    assert "experts: 8, 2 active per token" in capsys.readouterr().out
