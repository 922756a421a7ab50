"""Several `tandem bench` runs on GGUF files as one side-by-side table (BENCHMARKS.md).

    tandem bench --model A.gguf --layouts single,tp2,pp2 --passes 2 --out out-a
    tandem bench --model B.gguf --layouts single,tp2,pp2 --passes 2 --out out-b
    python scripts/bench/gguf_layouts.py out-a/bench.json out-b/bench.json

Per file, link and layout: decode tok/s (batch 1; the best pass and the median of the passes),
decode speed against the same link's single node (best against best, median against median),
prefill tok/s and TTFT (the best pass), synchronization per decode token (TP: the ranks' traced collectives;
PP: M hops of one hidden state, each the measured 2-rank ring op), wire bytes per decode token
through the emulated hosts' interfaces, and whether the greedy ids equal single's. Then the
projection of each to the paper's 168 tok/s node pair (`tandem.bench.report._projection`).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _name(doc: dict) -> str:
    m = doc["model"]
    return f"{Path(m['path']).name} ({m['weight_format']}, {m['file_bytes'] / 1e6:.0f} MB)"


def median_tok_s(run: dict) -> float:
    """Decode tok/s of the median pass (the passes that did not fail)."""
    times = [t for t in run.get("passes_decode_s_per_token", []) if t is not None]
    return 1.0 / statistics.median(times or [run["decode_s_per_token"]])


def rows(doc: dict) -> list[str]:
    """One markdown row per measured layout of one bench run."""
    out = []
    singles = {r["link"]: r for r in doc["runs"] if r.get("kind") == "single" and "error" not in r}
    for r in doc["runs"]:
        model = Path(doc["model"]["path"]).name
        link = "emulated" if r["link"].startswith("emulated") else "loopback"
        if "error" in r:
            out.append(f"| {model} | {link} | {r['layout']} | failed: {r['error'][:60]} |||||||")
            continue
        single = singles.get(r["link"])
        rel = r["decode_tok_per_s"] / single["decode_tok_per_s"] if single else float("nan")
        med = median_tok_s(r)
        rel_med = med / median_tok_s(single) if single else float("nan")
        same = "yes" if single and r["token_ids"] == single["token_ids"] else "NO"
        if single and same == "NO":  # where they part (a near-tie there is no error: BENCHMARKS)
            first = next(
                i for i, (a, b) in enumerate(zip(r["token_ids"], single["token_ids"])) if a != b
            )
            same += f" (from token {first})"
        sync = doc.get("sync", {}).get(link, {}).get(r["layout"], {})
        ms = sync.get("ms_per_token")
        wire = r.get("wire_bytes_per_token")
        wire_s = (
            "-" if wire is None else f"{wire:.0f}" + (" (shm)" if r.get("same_host_memory") else "")
        )
        out.append(
            f"| {model} | {link} | {r['layout']} | {r['decode_tok_per_s']:.2f} ({med:.2f}) | "
            f"{rel:.2f}x ({rel_med:.2f}x) | "
            f"{r['prefill_tok_per_s']:.1f} | {r['ttft_s']:.3f} | "
            f"{'-' if ms is None or r['kind'] == 'single' else f'{ms:.2f}'} | {wire_s} | {same} |"
        )
    return out


def projection(doc: dict) -> list[str]:
    """The paper's node pair with this run's sync per token on the emulated link."""
    pr = doc.get("projection", {})
    model, out = Path(doc["model"]["path"]).name, []
    for how in ("isolated", "in_place"):
        t = pr.get("tp2", {}).get(how)
        if t:
            out.append(f"| {model} | TP=2 ({how}) | {t['sync_ms']:.2f} | {t['tok_s']:.1f} | "
                       f"tax {t['tax']:.2f}x (target < 1.5x: {'met' if t['met'] else 'NOT met'}) |")  # fmt: skip
    p = pr.get("pp2", {}).get("isolated")
    if p:
        out.append(f"| {model} | PP=2 (isolated) | {p['sync_ms']:.2f} | {p['tok_s']:.1f} | "
                   f"{p['slowdown'] * 100:.1f}% slower (target <= 10%: "
                   f"{'met' if p['met'] else 'NOT met'}) |")  # fmt: skip
    p = pr.get("pp2", {}).get("side_by_side")
    if p:
        out.append(f"| {model} | PP=2 measured here, emulated link | - | - | {p['vs_single']:.2f}x "
                   f"single on this CPU ({'met' if p['met'] else 'NOT met'}) |")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    docs = [json.loads(Path(p).read_text()) for p in (argv or sys.argv[1:])]
    if not docs:
        print(__doc__, file=sys.stderr)
        return 2
    lines = ["Files: " + "; ".join(_name(d) for d in docs), ""]
    for d in docs:
        links = ", ".join(f"{f['name']} RTT {f['rtt_s'] * 1e6:.0f} us, "
                          f"{f['goodput_bytes_per_s'] / 1e6:.0f} MB/s" for f in d["links"].values())  # fmt: skip
        lines.append(f"- {Path(d['model']['path']).name}: `{d.get('command', '?')}`; links {links}; "
                     f"load average {d['machine'].get('loadavg')} to "
                     f"{d['machine'].get('loadavg_end', '?')}")  # fmt: skip
    lines += ["", "| file | link | layout | decode tok/s best (median) | vs single best (median) | prefill tok/s | TTFT s | "
              "sync ms/token | wire B/token | same ids |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in docs:
        lines += rows(d)
    lines += ["", "Projected to the paper's node pair (168 tok/s alone) with the sync per token "
              "measured on the emulated link:", "",
              "| file | layout | sync ms/token | tok/s | against the target |", "|---|---|---|---|---|"]  # fmt: skip
    for d in docs:
        lines += projection(d)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
