"""Turns a `tandem bench` result into checks, projections, a markdown table and a PNG chart.

`analyze(doc)` adds:
  - `predictions`: `plan_model` for every measured TP/PP run, from the measured single-node speed
    and the link's measured RTT and goodput; the ring's software cost per message is calibrated on
    the all-reduce microbenchmark (2 ranks, one hidden state; its "cold" figure when measured:
    each op after streaming 64 MB, as decode's ops follow weight reads), never on the layout runs.
    TP runs also pay the host's lockstep penalty per sync (`lockstep.py`'s probe, run by the bench
    just before each link's layouts on that link's hosts, apart from them), net of this same
    slots and of the all-reduce of the link the probe ran over (`lockstep_penalties`);
    `predicted_tok_s_no_lockstep` is the prediction without it.
  - `sync`: per link and layout, synchronization per decode token (`_sync_entry`): for TP measured
    in place from every rank's collective trace, split into host staging, reduction and the rest.
  - `projection`: the paper's node pair (168 tok/s alone) with our measured per-token sync added:
    TP=2 tax and PP=2 slowdown, against the issue's targets (< 1.5x, within 10%).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tandem.deltanet_config import DeltaNetSpec
from tandem.moe_config import MoESpec
from tandem.plan.model import Layout, LinkSpec, NodeSpec, predict

PAPER = {"single_tok_s": 168.0, "tp2_tok_s": 50.4, "prefill_tok_s": 464.0, "tp2_prefill_tok_s": 213.0,
         "ttft_s": 0.09, "sync_ms_per_token": 14.0, "allreduces_per_token": 56,
         "goodput_mb_s": 280.0}  # fmt: skip
TARGET_TP2_TAX = 1.5
TARGET_PP2_SLOWDOWN = 0.10
TARGET_PLAN_ERROR = 0.20


def _ok_runs(doc: dict) -> list[dict]:
    return [r for r in doc["runs"] if "error" not in r]


def _single(doc: dict, link_name: str | None = None) -> dict | None:
    """The single-node control run next to `link_name`'s runs (the load drifts on a shared
    machine), else the first one."""
    singles = [r for r in _ok_runs(doc) if r["kind"] == "single"]
    same = [r for r in singles if r["link"] == link_name]
    return (same or singles or [None])[0]


def _ring_small(doc: dict, link: str, world: int = 2) -> dict | None:
    for a in doc.get("allreduce", []):
        if a["link"] == link and a["backend"] == "ring" and a["world"] == world:
            return a["sizes"][0]
    return None


def link_spec(doc: dict, link: str, hidden_bytes: int, cold: bool = True) -> LinkSpec:
    """The link's figures plus the ring's per-message software cost: by default the op as this
    machine's CPU ranks meet it in decode (`cold_median_s`: caches flushed by streaming weights,
    when measured); `cold=False` takes the back-to-back op (a node whose host thread does not
    stream the weights, e.g. a GPU node's). Either way one message of `hidden_bytes` costs the
    measured op (`LinkSpec.message_s`), whichever of latency or software cost explains it."""
    fig = doc["links"][link]
    rtt, goodput = fig["rtt_s"], fig["goodput_bytes_per_s"]
    ring = _ring_small(doc, link)
    wire_only = rtt / 2 + hidden_bytes / goodput
    op = ((cold and ring.get("cold_median_s")) or ring["median_s"]) if ring else 0.0
    if ring and op < wire_only:
        # the ring's op beats half the ping-pong's round trip plus the payload: that RTT is timed
        # with blocking receives (a sleeping receiver woken twice), while the ring's receiver
        # spins. The latency its messages see is what the op leaves after the payload, so the
        # model's message of the hidden state's size costs the measured op, not more.
        return LinkSpec(rtt_s=2 * max(0.0, op - hidden_bytes / goodput),
                        goodput_bytes_per_s=goodput)  # fmt: skip
    overhead = op - wire_only if ring else 0.0
    return LinkSpec(rtt_s=rtt, goodput_bytes_per_s=goodput, overhead_s=overhead)


def _probe(doc: dict, link: str) -> dict | None:
    """The lockstep probe run next to `link`'s layouts (else any): `doc["lockstep"]` maps a link
    to `measure_lockstep`'s figures, or is one probe for the whole run."""
    probes = doc.get("lockstep") or {}
    if "by_k" in probes:
        return probes
    ok = {k: v for k, v in probes.items() if isinstance(v, dict) and v.get("by_k")}
    return ok.get(link) or next(iter(ok.values()), None)


def lockstep_penalties(
    doc: dict, config: Any, s_node: float, slots: float, link: str = "loopback"
) -> tuple[tuple[int, float], ...]:
    """The bench's lockstep probe as (k, seconds per sync) beyond the plan's own terms for one
    segment + all-reduce on this host: the prediction's node speed and `slots`, and the spec of
    the link the probe's ranks talked over (its `link`; loopback for probes that predate it);
    () when the bench did not run the probe."""
    from tandem.plan.lockstep import link_penalties

    probe = _probe(doc, link)
    if probe is None or not doc.get("links"):
        return ()
    over = probe.get("link", "loopback")
    spec = link_spec(doc, over if over in doc["links"] else link, 4 * config.hidden_size)
    return link_penalties(probe, config, s_node, slots, spec)


def concurrent_slots(conc: dict, s_single: float, threads: int) -> float:
    """How many of the concurrency probe's k decodes this host runs at full speed at once:
    k t_alone / t_together, in [1, k].

    t_alone is the single layout's own measured time (`s_single`, the node speed the prediction
    divides) when the probe's processes ran with the same threads, else the probe's own alone
    run. Both were measured minutes apart on a shared machine, but taking the prediction's own
    node speed leaves one noisy figure (t_together) instead of two: with slots from the probe's
    own ratio, a probe run in a quieter minute than the single layout (152 vs 190 ms per token,
    one run here) put TP=2 on loopback 22% below its measured speed."""
    if "together_s_per_token" not in conc:  # a report saved with the slots alone
        return float(conc["slots"])
    k = int(conc["k"])
    alone = s_single if max(1, threads // k) == threads else conc["alone_s_per_token"]
    return min(float(k), max(1.0, k * alone / conc["together_s_per_token"]))


def analyze(doc: dict) -> dict:
    config = SimpleNamespace(**doc["model"])  # HF field names, as plan_model reads them
    if isinstance(getattr(config, "moe", None), dict):  # a mixture of experts, as JSON wrote it
        moe = dict(config.moe, dense_layers=tuple(config.moe.get("dense_layers", ())))
        config.moe = MoESpec(**moe)
    if isinstance(getattr(config, "deltanet", None), dict):  # a hybrid's DeltaNet layers, likewise
        net = dict(config.deltanet, linear_layers=tuple(config.deltanet["linear_layers"]))
        config.deltanet = DeltaNetSpec(**net)
    single = _single(doc)
    if single is None:
        doc["predictions"], doc["sync"], doc["projection"] = [], {}, {}
        return doc
    hidden_bytes = 4 * config.hidden_size
    cores = int(doc.get("machine", {}).get("cores") or 1)
    threads = int(doc.get("options", {}).get("threads") or 1)
    preds, sync = [], {}
    link_names = {doc["links"][k]["name"]: k for k in doc["links"]}
    for run in _ok_runs(doc):
        if run["kind"] == "single":
            continue
        link = link_names[run["link"]]
        s_single = _single(doc, run["link"])["decode_s_per_token"]
        # one machine: as many ranks at once as it has cores for their threads, and no more than
        # the measured speed-up of concurrent decodes (they share the memory bandwidth)
        per_rank = max(1, threads // run["n"]) if run["kind"] == "tp" else threads
        slots = float(max(1, cores // per_rank))
        if "concurrency" in doc:
            slots = min(slots, concurrent_slots(doc["concurrency"], s_single, threads))
        pen = lockstep_penalties(doc, config, s_single, slots, link)
        nodes = [NodeSpec(f"rank{i}", s_single, "this machine", slots, pen) for i in range(8)]
        spec = link_spec(doc, link, hidden_bytes)
        lay = Layout(tp=run["n"]) if run["kind"] == "tp" else Layout(pp=run["n"])
        p = predict(config, lay, nodes, spec)
        measured = run["decode_tok_per_s"]
        preds.append({"layout": run["layout"], "link": link, "measured_tok_s": measured,
                      "predicted_tok_s": p.tok_per_s, "error": measured / p.tok_per_s - 1,
                      "predicted_tok_s_no_lockstep": 1 / (p.s_per_token - p.lockstep_s),
                      "predicted_lockstep_ms": p.lockstep_s * 1e3,
                      "lockstep_penalty_us": {str(k): v * 1e6 for k, v in pen},
                      "predicted_sync_ms": p.sync_s * 1e3,
                      "predicted_wire_bytes_per_token": p.wire_bytes_per_token,
                      "calibrated_overhead_us": spec.overhead_s * 1e6})  # fmt: skip
        sync.setdefault(link, {})[run["layout"]] = _sync_entry(doc, run, s_single, link, config)
    doc["predictions"] = preds
    doc["sync"] = sync
    isolated = {}
    if "emulated" in doc["links"]:  # the paper's GPU nodes: their host threads stay hot
        hot = link_spec(doc, "emulated", hidden_bytes, cold=False)
        nodes = [NodeSpec(f"rank{i}", 1.0 / PAPER["single_tok_s"]) for i in range(2)]
        for lay in (Layout(tp=2), Layout(pp=2)):
            isolated[lay.name] = predict(config, lay, nodes, hot).sync_s * 1e3
    doc["projection"] = _projection(sync, isolated)
    return doc


def _sync_entry(doc: dict, run: dict, s_single: float, link: str, config: Any) -> dict:
    """TP: the collectives' own time per token from the ranks' traces (`optrace`), split into
    host staging and reduction (timed alone in the all-reduce run) and the rest (wire, framing,
    wake-ups). PP: M hops of one hidden state, each taken as one 2-rank ring exchange of it on this
    link (the all-reduce run), since the stage links are not traced. Both also give the wall-time
    difference to single, which on a shared machine is mostly noise."""
    wall = (run["decode_s_per_token"] - s_single) * 1e3
    entry: dict[str, Any] = {
        "wall_diff_ms": wall,
        "vs_single": s_single / run["decode_s_per_token"],  # decode speed, side by side
        "wire_bytes_per_token": run.get("wire_bytes_per_token"),
    }
    ring = _ring_small(doc, link, run["n"] if run["kind"] == "tp" else 2)
    if run["kind"] == "tp" and "sync_in_place" in run:
        sp = run["sync_in_place"]
        n_ar = sp["by_kind"].get("all_reduce_sum", {}).get("count", 0) / max(
            run["decode_tokens"], 1
        )
        entry.update(source="traced collectives", ms_per_token=sp["ms_per_token"],
                     skew_ms_per_token=sp["skew_ms_per_token"], allreduces_per_token=n_ar,
                     collectives_per_token=sp["collectives_per_token"])  # fmt: skip
        if ring and "staging_s" in ring:
            staging, reduction = n_ar * ring["staging_s"] * 1e3, n_ar * ring["reduction_s"] * 1e3
            entry.update(allreduce_us=ring["median_s"] * 1e6, staging_ms=staging,
                         reduction_ms=reduction,
                         wire_ms=max(sp["ms_per_token"] - staging - reduction, 0.0))  # fmt: skip
    elif run["kind"] == "pp" and ring:
        entry.update(source="M x one 2-rank exchange of a hidden state",
                     ms_per_token=run["n"] * ring["median_s"] * 1e3)  # fmt: skip
    else:
        entry.update(source="wall-time difference", ms_per_token=wall)
    return entry


def _projection(sync: dict, isolated: dict) -> dict:
    """The paper's 168 tok/s node pair plus our sync per token on the emulated link, two ways:
    `isolated` composes the all-reduce run's back-to-back op cost and the link figures
    (plan_model), which is what a node whose host thread keeps the comm path in cache pays (a GPU
    node: its weights stream on the device; its device<->host copies are not measured here);
    `in_place` (TP) is the traced collectives inside this machine's CPU decode, each op cold
    after the weights streamed through the caches (and, on a shared machine, scheduler
    preemption); PP's stage links are not traced, so PP also reports its measured speed side by
    side with single (`side_by_side`). Conservative: TP compute does not shrink (small-model
    decode on a GPU is launch-bound); also shown if it halves."""
    em = sync.get("emulated", {})
    t1 = 1.0 / PAPER["single_tok_s"]
    out: dict[str, Any] = {"node_tok_s": PAPER["single_tok_s"]}
    if "TP=2" in em:
        tp: dict[str, Any] = {"target_tax": TARGET_TP2_TAX,
                              "paper_tax": PAPER["single_tok_s"] / PAPER["tp2_tok_s"]}  # fmt: skip
        for how, ms in (
            ("isolated", isolated.get("TP=2")),
            ("in_place", em["TP=2"]["ms_per_token"]),
        ):
            if ms is None:
                continue
            s = max(ms, 0.0) / 1e3
            tax = (t1 + s) / t1
            tp[how] = {"sync_ms": s * 1e3, "tok_s": 1 / (t1 + s), "tax": tax,
                       "tok_s_if_compute_halves": 1 / (t1 / 2 + s), "met": tax < TARGET_TP2_TAX}  # fmt: skip
        out["tp2"] = tp
    if "PP=2" in em:
        pp: dict[str, Any] = {"target_slowdown": TARGET_PP2_SLOWDOWN}
        ms = isolated.get("PP=2")
        if ms is not None:
            s = max(ms, 0.0) / 1e3
            pp["isolated"] = {"sync_ms": s * 1e3, "tok_s": 1 / (t1 + s), "slowdown": s / t1,
                              "met": s / t1 <= TARGET_PP2_SLOWDOWN}  # fmt: skip
        # not projected: the stage links are not traced, and the wall-time difference of two CPU
        # decodes is this box's noise (+-15% between passes), not a cost a 168 tok/s node pays
        ratio = em["PP=2"].get("vs_single")
        if ratio is not None:
            slow = max(0.0, 1 / ratio - 1)
            pp["side_by_side"] = {"vs_single": ratio, "slowdown": slow,
                                  "met": slow <= TARGET_PP2_SLOWDOWN}  # fmt: skip
        out["pp2"] = pp
    return out


# ---- rendering ------------------------------------------------------------------------------------


def markdown(doc: dict) -> str:
    m, lines = doc["machine"], []
    lines.append(f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel "
                 f"{m['kernel']}, torch {m['torch']}; load average {m.get('loadavg', '?')}.")  # fmt: skip
    model = doc.get("model", {})
    if model.get("weight_format"):
        lines.append(f"- model: {Path(model['path']).name} ({model['weight_format']}, "
                     f"{model['file_bytes'] / 1e6:.1f} MB on disk)"
                     + ("; every rank on its blocks, no HF peer (it would dequantize)"
                        if model.get("gguf") else ""))  # fmt: skip
    single = _single(doc)
    if single and single.get("kernel_layers"):
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(single["kernel_layers"].items()))
        lines.append(f"- single node's linear layers by kernel: {kinds}")
    for fig in doc["links"].values():
        lines.append(f"- {fig['name']}: RTT {fig['rtt_s'] * 1e6:.0f} us, TCP goodput "
                     f"{fig['goodput_bytes_per_s'] / 1e6:.0f} MB/s")  # fmt: skip
    o = doc.get("options", {})
    if o.get("rounds"):
        lines.append(f"- each figure: the best of {o.get('passes', 1)} pass(es) per layout and "
                     f"link, interleaved over the layouts, each the best of {o['rounds']} timed "
                     "generations")  # fmt: skip
    lines += ["", "| link | layout | decode tok/s | vs single | prefill tok/s | TTFT s | "
              "sync ms/token | wire KB/token | same ids |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in doc["runs"]:
        single = _single(doc, r["link"])
        if "error" in r:
            lines.append(f"| {r['link']} | {r['layout']} | failed: {r['error'][:80]} ||||||")
            continue
        rel = r["decode_tok_per_s"] / single["decode_tok_per_s"] if single else float("nan")
        same = "yes" if single and r["token_ids"] == single["token_ids"] else "NO"
        link = "emulated" if r["link"].startswith("emulated") else "loopback"
        s = doc.get("sync", {}).get(link, {}).get(r["layout"], {})
        wire = r.get("wire_bytes_per_token")
        wire_kb = "-" if wire is None else f"{wire / 1e3:.1f}"
        if r.get("same_host_memory"):
            wire_kb += " (shm)"  # same-host shared memory: the all-reduces cross no socket
        lines.append(
            f"| {r['link']} | {r['layout']} | {r['decode_tok_per_s']:.2f} | {rel:.2f}x | "
            f"{r['prefill_tok_per_s']:.1f} | {r['ttft_s']:.3f} | "
            f"{s.get('ms_per_token', 0.0):.2f} | {wire_kb} | {same} |"
        )
    hf = doc.get("peers", {}).get("hf")
    single = _single(doc)
    if hf and "error" not in hf:
        lines.append(f"| - | HF transformers (peer) | {hf['decode_tok_per_s']:.2f} | "
                     f"{hf['decode_tok_per_s'] / single['decode_tok_per_s'] if single else 0:.2f}x | "
                     f"{hf['prefill_tok_per_s']:.1f} | {hf['ttft_s']:.3f} | - | - | "
                     f"{'yes' if single and hf['token_ids'] == single['token_ids'] else 'NO'} |")  # fmt: skip
    if any(r.get("same_host_memory") for r in doc["runs"]):
        lines += ["", "wire KB/token: bytes through the hosts' network interfaces; (shm): the two "
                  "ranks share a host and swap their small all-reduces and broadcasts through "
                  "shared memory, so those cross no socket."]  # fmt: skip
    lines += _sync_table(doc) + _allreduce_table(doc) + _prediction_table(doc)
    lines += _projection_lines(doc)
    return "\n".join(lines) + "\n"


def _sync_table(doc: dict) -> list[str]:
    rows = [(link, lay, e) for link, d in doc.get("sync", {}).items() for lay, e in d.items()]
    if not rows:
        return []
    out = ["", "Synchronization per decode token:", "",
           "| link | layout | sync ms/token | host staging ms | reduction ms | wire+rest ms | "
           "waiting for the slower rank ms | collectives/token | wall diff to single ms | source |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for link, lay, e in rows:

        def f(key: str, e=e) -> str:
            return f"{e[key]:.2f}" if isinstance(e.get(key), float) else "-"

        out.append(f"| {link} | {lay} | {f('ms_per_token')} | {f('staging_ms')} | "
                   f"{f('reduction_ms')} | {f('wire_ms')} | {f('skew_ms_per_token')} | "
                   f"{e.get('collectives_per_token', '-')} | {f('wall_diff_ms')} | "
                   f"{e.get('source', '')} |")  # fmt: skip
    return out


def _allreduce_table(doc: dict) -> list[str]:
    if not doc.get("allreduce"):
        return []
    out = ["", "All-reduce, median (p90) per op, same run:", "",
           "| link | ranks | backend | " + " | ".join(
               f"{s['bytes'] / 1024:.0f} KiB" for s in doc["allreduce"][0]["sizes"]) + " |"]  # fmt: skip
    out.append("|---|---|---|" + "---|" * len(doc["allreduce"][0]["sizes"]))
    for a in doc["allreduce"]:
        cells = " | ".join(
            f"{s['median_s'] * 1e6:.0f} us ({s['p90_s'] * 1e6:.0f})" for s in a["sizes"]
        )
        out.append(f"| {a['link']} | {a['world']} | {a['backend']} | {cells} |")
    return out


def _prediction_table(doc: dict) -> list[str]:
    if not doc.get("predictions"):
        return []
    out = ["", "`tandem plan` predictions vs measured (target: within 20%):", "",
           "| link | layout | measured tok/s | predicted tok/s | error | within 20% | "
           "lockstep ms/token | predicted without lockstep |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in doc["predictions"]:
        ok = abs(p["error"]) <= TARGET_PLAN_ERROR
        no_lock = p.get("predicted_tok_s_no_lockstep", p["predicted_tok_s"])
        out.append(f"| {p['link']} | {p['layout']} | {p['measured_tok_s']:.2f} | "
                   f"{p['predicted_tok_s']:.2f} | {p['error'] * 100:+.0f}% | {'yes' if ok else 'NO'} | "
                   f"{p.get('predicted_lockstep_ms', 0.0):.1f} | {no_lock:.2f} |")  # fmt: skip
    rows = []
    for link in dict.fromkeys(p["link"] for p in doc["predictions"]):
        probe = _probe(doc, link)
        if probe is None:
            continue
        pen = next((p["lockstep_penalty_us"] for p in doc["predictions"] if p["link"] == link
                    and p["layout"].startswith("TP") and p.get("lockstep_penalty_us")), {})  # fmt: skip
        for k, f in probe["by_k"].items():  # the penalties as the TP predictions took them
            rows.append(f"| {link} | {k} | {f['alone_s'] * 1e6:.0f} | {f['free_s'] * 1e6:.0f} | "
                        f"{f['lockstep_s'] * 1e6:.0f} | {pen.get(k, 0.0):.0f} |")  # fmt: skip
    if rows:
        out += ["", "Lockstep probe (k ranks on this machine, on the hosts of the link it is listed "
                "with (loopback for probes saved before that), each its TP shard of a decoder "
                "layer, all-reducing after attention and after the MLP; `lockstep.py`; run just "
                "before that link's layouts), per sync:", "",
                "| next to link | k | rank 0's shard alone us | k shards at once us | shards + "
                "all-reduce in lockstep us | penalty per sync us |",
                "|---|---|---|---|---|---|", *rows]  # fmt: skip
    return out


def _projection_lines(doc: dict) -> list[str]:
    pr = doc.get("projection", {})
    out = ["", f"Projection to the paper's node pair ({PAPER['single_tok_s']:.0f} tok/s alone) "
           "with our sync per token on the emulated link (isolated: the all-reduce run's "
           "back-to-back op cost, as a node whose host thread stays hot pays it (a GPU node; its "
           "device-host copies not measured here), composed by `tandem plan`; in place: traced "
           "inside this machine's CPU decode, every op cold after the weights streamed):", ""]  # fmt: skip
    for how in ("isolated", "in_place"):
        t = pr.get("tp2", {}).get(how)
        if t:
            out.append(f"- TP=2 ({how}): {t['sync_ms']:.2f} ms sync/token -> {t['tok_s']:.1f} tok/s, "
                       f"tax {t['tax']:.2f}x (target < {TARGET_TP2_TAX}x: "
                       f"{'met' if t['met'] else 'NOT met'}; paper {pr['tp2']['paper_tax']:.1f}x); "
                       f"{t['tok_s_if_compute_halves']:.1f} tok/s if compute halves")  # fmt: skip
        p = pr.get("pp2", {}).get(how)
        if p:
            out.append(f"- PP=2 ({how}): {p['sync_ms']:.2f} ms/token -> {p['tok_s']:.1f} tok/s, "
                       f"{p['slowdown'] * 100:.1f}% slower (target <= 10%: "
                       f"{'met' if p['met'] else 'NOT met'})")  # fmt: skip
    p = pr.get("pp2", {}).get("side_by_side")
    if p:
        out.append(f"- PP=2 measured side by side with single on the emulated link (this box's "
                   f"CPU decode, not projected): {p['vs_single']:.2f}x single, "
                   f"{p['slowdown'] * 100:.1f}% slower (target <= 10%: "
                   f"{'met' if p['met'] else 'NOT met'})")  # fmt: skip
    return out if len(out) > 3 else []


def main(argv: list[str] | None = None) -> int:
    """Re-renders a saved result: `python -m tandem.bench.report OUT/bench.json`."""
    import json
    import sys

    path = Path((argv or sys.argv[1:])[0])
    doc = analyze(json.loads(path.read_text()))
    path.write_text(json.dumps(doc, indent=2))
    (path.parent / "bench.md").write_text(markdown(doc))
    chart(doc, str(path.parent / "bench.png"))
    print(markdown(doc))
    return 0


def chart(doc: dict, path: str) -> bool:
    """Decode tok/s per layout and link, measured vs predicted; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = _ok_runs(doc)
    preds = {(p["link"], p["layout"]): p["predicted_tok_s"] for p in doc.get("predictions", [])}
    labels, measured, predicted = [], [], []
    for r in runs:
        link = "emulated" if r["link"].startswith("emulated") else "loopback"
        labels.append(f"{r['layout']}\n{link}")
        measured.append(r["decode_tok_per_s"])
        predicted.append(preds.get((link, r["layout"]), 0.0))
    hf = doc.get("peers", {}).get("hf")
    if hf and "error" not in hf:
        labels.append("HF\npeer")
        measured.append(hf["decode_tok_per_s"])
        predicted.append(0.0)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], predicted, 0.4, label="tandem plan")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title(f"{doc['model'].get('architecture', '')} decode, {doc['machine']['cpu'][:40]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
