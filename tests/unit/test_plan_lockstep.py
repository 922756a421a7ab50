"""The plan's lockstep term: a host's per-sync penalty, paid once per sync by TP groups only."""

import argparse
import dataclasses
import json
from types import SimpleNamespace

import pytest
from test_plan_model import CFG  # the plan model's tiny config (a sibling test module)

from tandem.bench.report import analyze, concurrent_slots, markdown
from tandem.cli import plan
from tandem.config import ModelConfig
from tandem.kernels import native
from tandem.models.presets import get_preset
from tandem.models.quant.blocks import BY_NAME
from tandem.parallel.partition import model_cost
from tandem.plan.lockstep import (
    _bytes_per_param,
    _layers,
    model_sync_s,
    penalties,
    penalty_s,
    shard_config,
    syncs_per_token,
    weight_types,
)
from tandem.plan.model import (
    Layout,
    LinkSpec,
    NodeSpec,
    PlanModelError,
    allreduce_s,
    parse_lockstep,
    predict,
)

LINK = LinkSpec(rtt_s=100e-6, goodput_bytes_per_s=1e6, overhead_s=10e-6)
PEN = ((2, 1e-3), (3, 5e-3))


def _box(n, pen=PEN, slots=2.0):
    return [NodeSpec(f"r{i}", 0.01, host="box", slots=slots, lockstep_s=pen) for i in range(n)]


def test_tp_pays_the_hosts_penalty_once_per_sync_on_top_of_the_old_prediction():
    with_pen = predict(CFG, Layout(tp=2), _box(2), LINK)
    without = predict(CFG, Layout(tp=2), _box(2, pen=()), LINK)
    syncs = 2 * CFG.num_hidden_layers + 3  # both all-reduces per layer + embedding, control, argmax
    assert with_pen.lockstep_s == pytest.approx(syncs * 1e-3)
    assert with_pen.s_per_token == pytest.approx(without.s_per_token + syncs * 1e-3)
    assert (with_pen.compute_s, with_pen.sync_s) == (without.compute_s, without.sync_s)


def test_the_penalty_is_the_one_measured_at_the_ranks_on_that_host():
    assert predict(CFG, Layout(tp=3), _box(3), LINK).lockstep_s == pytest.approx(11 * 5e-3)


def test_the_penalty_scales_with_the_number_of_syncs():
    deep = SimpleNamespace(**{**vars(CFG), "num_hidden_layers": 8})
    a = predict(CFG, Layout(tp=2), _box(2), LINK).lockstep_s
    b = predict(deep, Layout(tp=2), _box(2), LINK).lockstep_s
    assert (a, b) == (pytest.approx(11e-3), pytest.approx(19e-3))


def test_tp_times_pp_pays_per_stage_and_only_the_head_stage_adds_its_three_syncs():
    p = predict(CFG, Layout(tp=2, pp=2), _box(4), LINK)
    n0, n1 = p.stage_layers
    assert p.lockstep_s == pytest.approx(((2 * n0 + 3) + 2 * n1) * 1e-3)


def test_single_and_pp_only_layouts_pay_no_lockstep():
    assert predict(CFG, Layout(), _box(1), LINK).lockstep_s == 0
    for pp in (2, 3):
        p = predict(CFG, Layout(pp=pp), _box(pp), LINK)
        assert p.lockstep_s == 0
        assert p.s_per_token == pytest.approx(p.compute_s + p.sync_s)


def test_ranks_on_separate_machines_and_nodes_without_figures_pay_nothing():
    apart = [NodeSpec(f"r{i}", 0.01, lockstep_s=PEN) for i in range(2)]  # no host: own machine
    assert predict(CFG, Layout(tp=2), apart, LINK).lockstep_s == 0
    remote = [NodeSpec("gpu", 0.01), NodeSpec("evo", 0.01)]
    assert predict(CFG, Layout(tp=2), remote, LINK).lockstep_s == 0


def test_a_group_waits_for_its_slowest_host():
    mixed = [*_box(2), NodeSpec("gpu", 0.01)]  # 2 ranks on box, 1 alone on its own machine
    assert predict(CFG, Layout(tp=3), mixed, LINK).lockstep_s == pytest.approx(11 * 1e-3)


def test_lockstep_at_takes_the_largest_measured_k_not_above_the_ranks_here():
    n = NodeSpec("a", 0.01, host="box", lockstep_s=PEN)
    assert [n.lockstep_at(k) for k in (1, 2, 3, 5)] == [0.0, 1e-3, 5e-3, 5e-3]
    with pytest.raises(PlanModelError):
        NodeSpec("a", 0.01, lockstep_s=((1, 1e-3),))
    with pytest.raises(PlanModelError):
        NodeSpec("a", 0.01, lockstep_s=((2, -1e-3),))


def test_parse_lockstep_reads_host_and_penalties_and_refuses_garbage():
    host, pen = parse_lockstep("box:3=800us,2=0.3ms")
    assert host == "box" and [k for k, _ in pen] == [2, 3]
    assert [p for _, p in pen] == [pytest.approx(3e-4), pytest.approx(8e-4)]
    assert parse_lockstep("box:2=0") == ("box", ((2, 0.0),))
    for bad in ("box", "box:", ":2=1ms", "box:1=1ms", "box:2", "box:x=1ms", "box:2=fast"):
        with pytest.raises(PlanModelError):
            parse_lockstep(bad)


def _t_half(s_node):
    c = model_cost(CFG)
    return s_node * c.layer_params / (c.num_layers * c.layer_params + c.head_compute_params) / 2


def test_the_plans_time_per_sync_is_its_group_time_for_half_a_layer_plus_the_allreduce():
    t = _t_half(0.01)
    # 2 equal shards on a host of 2 slots: each at full speed; of 1.6 slots: they share it
    assert model_sync_s(CFG, 2, 0.01, 2.0, 2e-4) == pytest.approx(t / 2 + 2e-4)
    assert model_sync_s(CFG, 2, 0.01, 1.6, 2e-4) == pytest.approx(t / 1.6 + 2e-4)


def test_probe_penalty_is_the_measured_sync_beyond_the_plans_and_never_negative():
    assert penalty_s(2e-3, 1.5e-3) == pytest.approx(0.5e-3)
    assert penalty_s(1e-3, 1.5e-3) == 0.0
    probe = {"by_k": {"2": {"lockstep_s": 2e-3}, "3": {"lockstep_s": 4e-3}}}
    got = penalties(probe, CFG, 0.01, 2.0, lambda k: (k - 1) * 1e-4)
    assert got == {2: pytest.approx(2e-3 - model_sync_s(CFG, 2, 0.01, 2.0, 1e-4)),
                   3: pytest.approx(4e-3 - model_sync_s(CFG, 3, 0.01, 2.0, 2e-4))}  # fmt: skip


def test_probe_shards_follow_the_tp_plan_and_stream_at_least_the_pool():
    cfg = ModelConfig.from_hf_dict(
        {"architectures": ["Qwen3ForCausalLM"], **vars(CFG), "max_position_embeddings": 64}
    )
    for k in (2, 3):
        shards = [shard_config(cfg, k, r, pool_mb=1) for r in range(k)]
        assert sum(s.num_key_value_heads for s in shards) == CFG.num_key_value_heads
        assert sum(s.num_attention_heads for s in shards) == CFG.num_attention_heads
        assert sum(s.intermediate_size for s in shards) == CFG.intermediate_size
        layer_bytes = 4 * model_cost(CFG).layer_params / k
        assert shards[0].num_hidden_layers >= max(2, 2**20 / layer_bytes)
    assert syncs_per_token(CFG) == 11
    # a pool that would take more layers than a config may state: as many as it may (it built)
    assert shard_config(cfg, 2, 0, pool_mb=1 << 12).num_hidden_layers == 1024


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35-moe"])
def test_a_hybrids_probe_shards_keep_their_deltanet_layers_and_split_their_heads(preset):
    """The probe's first n layers of a hybrid keep the DeltaNet ones among them (it refused the
    model's full layer list for n layers), each rank its DeltaNet heads; the shard builds."""
    from tandem.models.llama import Transformer

    cfg = get_preset(preset).config
    net = cfg.deltanet
    shards = [shard_config(cfg, 2, r, pool_mb=1) for r in range(2)]
    for s in shards:
        n = s.num_hidden_layers
        assert s.deltanet.linear_layers == tuple(i for i in net.linear_layers if i < n)
        Transformer(s, with_embed=False, with_head=False)
    assert sum(s.deltanet.num_key_heads for s in shards) == net.num_key_heads
    assert sum(s.deltanet.num_value_heads for s in shards) == net.num_value_heads


@pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")
def test_a_gguf_files_probe_shards_multiply_its_block_types(tmp_path):
    """`weight_types` reads each projection's block type from the file's first layer (norms,
    float32 and stacked experts left out); the probe's shards hold random blocks of those types
    on the quantized kernel, one of them in a type whose block does not divide its width stays
    float32, and at fewer bytes a weight the pool holds more layers."""
    from tandem.kernels.quant_linear import QuantKernelLinear
    from tandem.loaders.gguf.writer import write_preset_gguf
    from tandem.loaders.source import open_model

    _, (f,) = write_preset_gguf(tmp_path / "m.gguf", "tiny-qwen3", "K_MIX")
    src = open_model(str(f))
    types = weight_types(src)
    assert types == {
        n[len("model.layers.0.") : -len(".weight")]: i.type_id for n, i in src.manifest.items()
        if n.startswith("model.layers.0.") and len(i.shape) == 2 and i.dtype != "F32"
    }  # fmt: skip
    assert "mlp.down_proj" in types and "input_layernorm" not in types
    assert weight_types(SimpleNamespace(config=src.config)) == {}  # no manifest: float32
    cfg = src.config
    odd = {**types, "mlp.up_proj": BY_NAME["Q4_K"].type_id}  # 256 does not divide 64 columns
    layers, _ = _layers(shard_config(cfg, 2, 0, 1, _bytes_per_param(odd)), odd)
    for layer in layers:
        for role, t in types.items():
            m = layer.get_submodule(role)
            if role == "mlp.up_proj":
                assert not isinstance(m, QuantKernelLinear)
            else:
                assert isinstance(m, QuantKernelLinear) and m.qtypes == (t,), role
    assert _bytes_per_param(types) < 1 and _bytes_per_param({}) == 4
    big = dataclasses.replace(cfg, num_hidden_layers=512)
    assert (
        shard_config(big, 2, 0, 1, _bytes_per_param(types)).num_hidden_layers
        > shard_config(big, 2, 0, 1).num_hidden_layers
    )


def _plan(argv, capsys):
    parser = argparse.ArgumentParser()
    plan.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args), capsys.readouterr()


def test_cli_lockstep_option_reaches_the_nodes_of_that_host_only(capsys):
    rc, out = _plan(["--preset", "qwen3-0.6b", "--node", "a:100ms@box", "--node", "b:100ms@box",
                     "--lockstep", "box:2=1ms", "--json"], capsys)  # fmt: skip
    assert rc == 0
    preds = {p["layout"]: p for p in json.loads(out.out)["predictions"]}
    assert preds["TP=2"]["lockstep_ms"] == pytest.approx(59.0)  # qwen3-0.6b: 2 x 28 + 3 syncs
    assert preds["PP=2"]["lockstep_ms"] == 0
    rc, out = _plan(["--preset", "qwen3-0.6b", "--node", "a:100ms@box", "--node", "b:100ms@elsewhere",
                     "--lockstep", "box:2=1ms", "--json"], capsys)  # fmt: skip
    preds = {p["layout"]: p for p in json.loads(out.out)["predictions"]}
    assert preds["TP=2"]["lockstep_ms"] == 0  # one rank per machine


def test_cli_refuses_a_malformed_lockstep_with_a_message(capsys):
    rc, out = _plan(
        ["--preset", "qwen3-0.6b", "--node", "a:100ms@box", "--lockstep", "box"], capsys
    )
    assert rc == 2 and "--lockstep" in out.err


def test_cli_table_names_the_penalty(capsys):
    rc, out = _plan(["--preset", "qwen3-0.6b", "--node", "a:100ms@box", "--node", "b:100ms@box",
                     "--lockstep", "box:2=1ms"], capsys)  # fmt: skip
    assert rc == 0 and "lockstep per sync on box: 2 ranks 1.000 ms" in out.out


def _bench_doc(probe):
    model = {"dir": "m", **vars(CFG)}
    run = {"decode_s_per_token": 0.01, "decode_tok_per_s": 100.0, "prefill_tok_per_s": 1.0,
           "ttft_s": 0.1, "token_ids": [1], "wire_bytes_per_token": None}  # fmt: skip
    ring = {"backend": "ring", "world": 2, "link": "loopback",
            "sizes": [{"bytes": 256, "median_s": 100e-6, "p90_s": 1e-4}]}  # fmt: skip
    return {"machine": {"cpu": "c", "cores": 2, "memory_gib": 1, "kernel": "k", "torch": "t"},
            "options": {"threads": 1}, "model": model, "allreduce": [ring], "peers": {},
            "links": {"loopback": {"name": "loopback", "rtt_s": 20e-6, "goodput_bytes_per_s": 1e9}},
            "concurrency": {"slots": 2.0},
            "runs": [{**run, "layout": "single", "kind": "single", "n": 1, "link": "loopback"},
                     {**run, "layout": "TP=2", "kind": "tp", "n": 2, "link": "loopback"},
                     {**run, "layout": "PP=2", "kind": "pp", "n": 2, "link": "loopback"}],
            "lockstep": probe}  # fmt: skip


def test_bench_report_predicts_tp_with_the_probes_penalty_and_pp_without():
    probe = {"by_k": {"2": {"alone_s": 1e-3, "free_s": 1e-3, "lockstep_s": 3e-3}}}
    doc = analyze(_bench_doc(probe))
    preds = {p["layout"]: p for p in doc["predictions"]}
    ar = allreduce_s(LinkSpec(20e-6, 1e9, 100e-6 - 10e-6 - 256 / 1e9), 2, 256)
    expected = penalty_s(3e-3, model_sync_s(CFG, 2, 0.01, 2.0, ar))
    assert expected > 0
    assert preds["TP=2"]["lockstep_penalty_us"]["2"] == pytest.approx(expected * 1e6)
    assert preds["TP=2"]["predicted_lockstep_ms"] == pytest.approx(11 * expected * 1e3)
    assert preds["PP=2"]["predicted_lockstep_ms"] == 0
    assert 1 / preds["TP=2"]["predicted_tok_s"] == pytest.approx(
        1 / preds["TP=2"]["predicted_tok_s_no_lockstep"] + 11 * expected
    )
    assert "Lockstep probe" in markdown(doc)


def test_host_slots_divide_the_predictions_own_node_speed_by_the_concurrent_decodes_time():
    conc = {"k": 2, "alone_s_per_token": 0.152, "together_s_per_token": 0.205, "slots": 1.48}
    # the single layout measured 0.190 s alone: 2 x 0.190 / 0.205, not the probe's own 1.48
    assert concurrent_slots(conc, 0.190, threads=1) == pytest.approx(2 * 0.190 / 0.205)
    # the probe ran with fewer threads than the single layout: its own alone run is the baseline
    assert concurrent_slots(conc, 0.100, threads=2) == pytest.approx(2 * 0.152 / 0.205)
    assert concurrent_slots(conc, 0.5, threads=1) == 2.0  # never more than k
    assert concurrent_slots(conc, 0.05, threads=1) == 1.0  # nor less than one
    assert concurrent_slots({"slots": 1.3}, 0.190, threads=1) == 1.3  # an older report


def test_bench_report_without_a_probe_predicts_as_before():
    doc = analyze(_bench_doc(None))
    tp = next(p for p in doc["predictions"] if p["layout"] == "TP=2")
    assert tp["predicted_lockstep_ms"] == 0
    assert tp["predicted_tok_s"] == pytest.approx(tp["predicted_tok_s_no_lockstep"])
    assert "Lockstep probe" not in markdown(doc)


def test_bench_report_takes_the_probe_run_next_to_each_links_layouts():
    near = {"by_k": {"2": {"alone_s": 1e-3, "free_s": 1e-3, "lockstep_s": 3e-3}}}
    far = {"by_k": {"2": {"alone_s": 1e-3, "free_s": 1e-3, "lockstep_s": 9e-3}}}
    by_link = analyze(_bench_doc({"emulated": far, "loopback": near}))
    alone = analyze(_bench_doc(near))
    tp = [next(p for p in d["predictions"] if p["layout"] == "TP=2") for d in (by_link, alone)]
    assert tp[0]["lockstep_penalty_us"] == tp[1]["lockstep_penalty_us"]
    assert "| loopback | 2 |" in markdown(by_link)


def test_a_probe_run_over_a_link_is_judged_against_that_links_all_reduce():
    # the bench runs the probe's ranks on the link's own hosts; its penalty subtracts the
    # all-reduce of that link (a slow link's sync is not lockstep waiting)
    from tandem.bench.report import lockstep_penalties

    by_k = {"2": {"alone_s": 1e-3, "free_s": 1e-3, "lockstep_s": 3e-3}}
    doc = _bench_doc(None)
    doc["links"]["emulated"] = {"name": "emulated", "rtt_s": 1e-3, "goodput_bytes_per_s": 1e8}
    doc["lockstep"] = {"emulated": {"by_k": by_k, "link": "emulated"}, "loopback": {"by_k": by_k}}
    ((k_emu, p_emu),) = lockstep_penalties(doc, CFG, 0.01, 2.0, "emulated")
    ((k_lo, p_lo),) = lockstep_penalties(doc, CFG, 0.01, 2.0, "loopback")
    assert k_emu == k_lo == 2
    ar = allreduce_s(LinkSpec(1e-3, 1e8), 2, 4 * CFG.hidden_size)
    assert p_emu == pytest.approx(penalty_s(3e-3, model_sync_s(CFG, 2, 0.01, 2.0, ar)))
    assert p_emu < p_lo  # the emulated link's 0.5 ms latency is the link's, not lockstep's
