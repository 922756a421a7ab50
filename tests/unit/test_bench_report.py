"""The bench report's arithmetic on a synthetic result: sync per token, projection, plan check."""

import json
from dataclasses import asdict

import pytest

from tandem.bench.report import analyze, markdown
from tandem.models.presets import get_preset

MODEL = {
    "dir": "m", "architecture": "Qwen3ForCausalLM", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 8, "tie_word_embeddings": True,
}  # fmt: skip
EMU = "emulated 2500 Mbit/s"


def _run(layout, kind, n, link, s, ids=(1, 2, 3)):
    return {"layout": layout, "kind": kind, "n": n, "link": link, "decode_s_per_token": s,
            "decode_tok_per_s": 1 / s, "prefill_tok_per_s": 100.0, "ttft_s": 0.1,
            "token_ids": list(ids), "wire_bytes_per_token": 1000.0}  # fmt: skip


def _doc():
    ring = {"backend": "ring", "world": 2, "link": "emulated",
            "sizes": [{"bytes": 256, "median_s": 100e-6, "p90_s": 200e-6, "staging_s": 5e-6,
                       "reduction_s": 1e-6, "wire_s": 94e-6}]}  # fmt: skip
    return {
        "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 1, "kernel": "k", "torch": "t"},
        "model": MODEL,
        "links": {"loopback": {"name": "loopback", "rtt_s": 20e-6, "goodput_bytes_per_s": 1e9},
                  "emulated": {"name": EMU, "rtt_s": 24e-6, "goodput_bytes_per_s": 3e8}},
        "runs": [_run("single", "single", 1, "loopback", 0.010),
                 {**_run("TP=2", "tp", 2, EMU, 0.012), "decode_tokens": 10,
                  "sync_in_place": {"ms_per_token": 1.5, "skew_ms_per_token": 0.4,
                                    "collectives_per_token": 11.0,
                                    "by_kind": {"all_reduce_sum": {"count": 90, "sync_s": 0.012}}}},
                 _run("PP=2", "pp", 2, EMU, 0.0103, ids=(1, 2, 4))],
        "allreduce": [ring], "peers": {},
    }  # fmt: skip


def test_tp_sync_comes_from_the_traces_and_splits_by_the_allreduce_run():
    doc = analyze(_doc())
    tp = doc["sync"]["emulated"]["TP=2"]
    assert tp["ms_per_token"] == pytest.approx(1.5)
    assert tp["wall_diff_ms"] == pytest.approx(2.0)
    assert tp["allreduces_per_token"] == 9
    assert tp["staging_ms"] == pytest.approx(9 * 5e-3)
    assert tp["staging_ms"] + tp["reduction_ms"] + tp["wire_ms"] == pytest.approx(1.5)


def test_pp_sync_is_one_hidden_state_exchange_per_stage():
    pp = analyze(_doc())["sync"]["emulated"]["PP=2"]
    assert pp["ms_per_token"] == pytest.approx(2 * 0.1)


def test_projection_adds_measured_sync_to_the_papers_168_tok_s_node():
    doc = analyze(_doc())
    pr = doc["projection"]
    assert pr["tp2"]["in_place"]["tax"] == pytest.approx((1 / 168 + 0.0015) * 168)
    assert pr["tp2"]["in_place"]["met"] is True
    iso = next(p for p in doc["predictions"] if p["layout"] == "TP=2")["predicted_sync_ms"]
    assert pr["tp2"]["isolated"]["sync_ms"] == pytest.approx(iso)
    # PP in place is the measured side-by-side ratio, never the CPU wall difference projected
    side = pr["pp2"]["side_by_side"]
    assert side["vs_single"] == pytest.approx(0.010 / 0.0103) and "in_place" not in pr["pp2"]
    assert side["slowdown"] == pytest.approx(0.03) and side["met"] is True


def test_plan_overhead_is_calibrated_on_the_allreduce_run_not_on_layouts():
    preds = {p["layout"]: p for p in analyze(_doc())["predictions"]}
    expected = 100e-6 - (24e-6 / 2 + 256 / 3e8)
    assert preds["TP=2"]["calibrated_overhead_us"] == pytest.approx(expected * 1e6)


def test_markdown_flags_a_layout_whose_greedy_ids_differ():
    md = markdown(analyze(_doc()))
    pp_row = next(line for line in md.splitlines() if "| PP=2 |" in line)
    assert pp_row.endswith("| NO |")
    assert "within 20%" in md


def test_markdown_marks_a_group_whose_all_reduces_went_through_shared_memory():
    doc = _doc()
    doc["runs"][1]["same_host_memory"] = True
    md = markdown(analyze(doc))
    tp_row = next(line for line in md.splitlines() if "| TP=2 |" in line)
    assert "1.0 (shm)" in tp_row and "cross no socket" in md
    assert "(shm)" not in markdown(analyze(_doc()))


def test_each_link_is_compared_with_the_single_control_run_next_to_it():
    doc = _doc()
    doc["runs"].append(_run("single", "single", 1, EMU, 0.011))
    tp = analyze(doc)["sync"]["emulated"]["TP=2"]
    assert tp["wall_diff_ms"] == pytest.approx(1.0)


def test_a_ring_op_faster_than_half_the_ping_pong_is_not_charged_more_than_measured():
    # the ping-pong RTT (blocking receives) overstates the latency the spinning ring sees: the
    # model's hidden-state message must cost the measured op, never the larger composed wire time
    from tandem.bench.report import link_spec

    doc = _doc()
    doc["links"]["emulated"]["rtt_s"] = 300e-6  # half of it alone exceeds the 100 us op
    spec = link_spec(doc, "emulated", 256)
    assert spec.message_s(256) == pytest.approx(100e-6)
    assert spec.overhead_s == 0.0 and spec.rtt_s < 300e-6
    doc["links"]["emulated"]["rtt_s"] = 24e-6  # the usual case: the op carries a software cost
    assert link_spec(doc, "emulated", 256).message_s(256) == pytest.approx(100e-6)


def test_reanalyze_rewrites_the_report_of_a_saved_run_and_refuses_a_missing_file(tmp_path):
    import json

    from tandem.cli.main import main

    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(_doc()))
    assert main(["bench", "--reanalyze", str(saved), "--out", str(tmp_path / "o")]) == 0
    doc = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert {p["layout"] for p in doc["predictions"]} == {"TP=2", "PP=2"}
    assert "predictions vs measured" in (tmp_path / "o" / "bench.md").read_text()
    assert main(["bench", "--reanalyze", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2


def test_a_mixture_of_experts_saved_as_json_is_analyzed_like_any_model():
    moe = {"num_experts": 8, "top_k": 2, "intermediate_size": 64, "norm_topk_prob": True,
           "router": "softmax_topk", "dense_layers": [1], "shared_intermediate_size": 0}  # fmt: skip
    doc = _doc()
    doc["model"] = {**MODEL, "architecture": "Qwen3MoeForCausalLM", "moe": moe}
    assert analyze(doc)["sync"]["emulated"]["TP=2"]["ms_per_token"] == pytest.approx(1.5)


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35-moe"])
def test_a_hybrids_report_reads_its_deltanet_layers_back_from_json(preset):
    """The harness writes the model's config with `asdict` into JSON; the report plans TP over a
    hybrid's DeltaNet heads from what it reads back (it raised AttributeError on the dict)."""
    config = get_preset(preset).config
    doc = json.loads(json.dumps({**_doc(), "model": {"dir": "m", **asdict(config)}}))
    preds = {p["layout"]: p for p in analyze(doc)["predictions"]}
    assert preds["TP=2"]["predicted_sync_ms"] > 0
