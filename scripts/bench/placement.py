"""Placement by measurement: two TP ranks whose speeds differ about 2x, an equal split against
`--tp-weights auto`, side by side (A B A B, medians).

    .venv/bin/python scripts/bench/placement.py [--model DIR] [--rounds 2] [--ratio 2]
                        [--slow-via shares|cgroup|taskset] [--slow-quota 0.5]
                        [--prompt-len 32] [--decode 16] [--dtype float32]

How the speeds differ (both ranks run one torch thread; rank 1, the worker, is the slow one):
  - `shares` (the default): each rank in its own cgroup-v1 `cpu` group, rank 0's CFS weight --ratio
    times rank 1's (220 : 110 at 2, 110 being a nice-10 task's weight). On a machine whose cores are
    contended (the 2-core build machine always is) a rank's CPU is its weight's part, so rank 1 runs
    at about 1/ratio of rank 0's speed, at every scale of time the scheduler slices.
  - `cgroup`: rank 1 under a CFS quota of --slow-quota CPUs over a 10 ms period, rank 0 in a
    group of its own with no quota (so on a contended machine both compete as one group entity of
    the same weight: rank 1 alone in a group beside rank 0 among the root's nice-10 tasks took a
    group's weight, 1024, against rank 0's 110, and ran the faster of the two). It binds only
    below the CPU share the load leaves each task, and a quota shapes a short GEMV window (the
    probe's) differently from a long decode: at load 7-8 a 0.25 quota did not bind and a 0.1 quota
    made the probe read 3.3x where the decode ran 5.5x.
  - `taskset`: where no cgroup is writable, rank 1 on core 0 with 1 thread, rank 0 on cores 0,1
    with 2.
Needs root for the cgroups (/sys/fs/cgroup/cpu writable).

Every layout is a fresh pair of processes (head and worker on the loopback ring), so every `auto`
run probes again. Per run, from both ranks' collective traces over the decode phase
(`tandem.bench.optrace`, one CLOCK_MONOTONIC):

  - compute ms/token of rank r: the gaps between its collectives (exit of one to entry of the
    next), i.e. its own work, never its waiting;
  - wait ms/token of rank r: the time it sat in a collective before the other rank arrived
    (max over ranks of the entry - its own entry, summed);
  - the independently timed speed ratio: (compute_slow / share_slow) / (compute_fast / share_fast),
    each rank's compute per unit of its plan share (work_share of the cluster view);
  - the probe's ratio: gemv_gb_s fast / slow (what `auto` sizes the shards from first), and the
    auto weights' ratio w_fast / w_slow (after the join's 8-step decode refined them, where it
    did: `engine/tp/refine.py`);
  - the in-service balancing ratio: the head's `measured_balance()` after the run (every rank's
    compute clock over the warm-up, prefill and decode steps, `engine/tp/balance.py`), as
    w_fast / w_slow: the weights the group would re-form with.

Greedy ids of every TP run are compared with a single-node run of the same model and dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_DIR = Path("/tmp/tandem-bench-qwen3-0.6b")
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
SHARE_UNIT = (
    110  # the CFS weight of a nice-10 task, what the other jobs on the build machine run at
)
LAYOUTS = {"equal": "1,1", "auto": "auto"}


# ------------------------------------------------------------------------------- child roles


def _greedy(ex, args, trace=None) -> dict:
    from tandem.bench.timing import prompt_ids, time_greedy

    prompt = prompt_ids(args.prompt_len, ex.vocab_size)
    time_greedy(ex, prompt[:8], 2, seq_id=1)  # warm-up
    marks: dict[str, int] = {}

    def phase(name: str) -> None:
        marks[name] = len(trace.ops) if trace is not None else 0

    t = time_greedy(ex, prompt, args.decode, seq_id=0, on_phase=phase)
    return {
        "decode_tok_s": t.decode_tok_per_s,
        "token_ids": list(t.token_ids),
        "span": [marks.get("decode_start", 0), marks.get("decode_end", 0)],
    }


def role_single(args) -> dict:
    from tandem.devices import DTYPE_NAMES
    from tandem.engine.local import LocalExecutor

    ex = LocalExecutor.from_dir(args.model, dtype=DTYPE_NAMES[args.dtype], max_batch=2)
    return _greedy(ex, args)


def role_tp(args) -> dict | None:
    from tandem.bench.optrace import TracedCommunicator
    from tandem.cli.worker import parse_peers, ring_from_args
    from tandem.engine.tp.setup import run_worker, start_head

    ring = ring_from_args(
        args.rank,
        2,
        parse_peers(args.peers, 2),
        os.environ["TANDEM_SECRET"].encode(),
        op_timeout=300.0,
        handshake_timeout=300.0,
        cluster_id="tandem-bench-placement",
    )
    trace = TracedCommunicator(ring)
    if args.rank != 0:
        try:
            run_worker(args.model, trace, dtype=args.dtype, device="cpu")
        finally:
            trace.dump(Path(args.trace_dir) / f"rank{args.rank}.json")
        return None
    weights = "auto" if args.weights == "auto" else tuple(map(float, args.weights.split(",")))
    from tandem.comm.metered import MeteredCommunicator

    ex = start_head(  # metered: the head's compute clock (`engine/tp/balance.py`)
        args.model,
        MeteredCommunicator(trace),
        weights=weights,
        max_batch=2,
        max_seq_len=256,
        dtype=args.dtype,
    )
    try:
        out = _greedy(ex, args, trace)
        bal = ex.measured_balance() or {}
        out["balanced_weights"] = bal.get("balanced_weights")
        out["weights"] = list(ex.layout.weights)
        out["shares"] = [f.work_share for f in ex.facts]
        out["gemv_gb_s"] = [f.probe["gemv_gb_s"] for f in ex.facts]
    finally:
        ex.close()
        trace.dump(Path(args.trace_dir) / "rank0.json")
    return out


# ------------------------------------------------------------------------------- the driver


def per_rank(traces: list[dict], start: int, end: int, tokens: int) -> dict:
    """Compute and wait ms/token of each rank over collectives [start, end) (module docstring)."""
    n = len(traces)
    compute, wait = [0.0] * n, [0.0] * n
    for i in range(start, end):
        enters = [t["ops"][i][1] for t in traces]
        last = max(enters)
        for r, t in enumerate(traces):
            wait[r] += last - enters[r]
            if i > start:
                compute[r] += enters[r] - t["ops"][i - 1][2]
    ms = 1000.0 / tokens
    return {"compute_ms": [c * ms for c in compute], "wait_ms": [w * ms for w in wait]}


class Slowdown:
    """Makes rank 1 the slow one: a CPU quota (`cgroup`), a smaller CFS weight than rank 0's
    (`shares`), or a core shared with fewer threads (`taskset`)."""

    def __init__(self, via: str, quota: float, ratio: float) -> None:
        self.via = via
        self.groups = [CGROUP_ROOT / f"tandem-placement-{os.getpid()}-r{r}" for r in (0, 1)]
        if via == "cgroup":  # both in a group of the same weight, only rank 1's capped
            self.groups[0].mkdir()
            self.groups[1].mkdir()
            (self.groups[1] / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.groups[1] / "cpu.cfs_quota_us").write_text(str(int(quota * PERIOD_US)))
        if via == "shares":
            for g, w in zip(self.groups, (ratio * SHARE_UNIT, SHARE_UNIT)):
                g.mkdir()
                (g / "cpu.shares").write_text(str(int(w)))

    def argv(self, rank: int) -> list[str]:
        if self.via == "taskset":
            return ["taskset", "-c", "0,1" if rank == 0 else "0"]
        return []

    def threads(self, rank: int) -> int:
        return 2 if self.via == "taskset" and rank == 0 else 1

    def enter(self, rank: int):
        procs = self.groups[rank] / "cgroup.procs"
        if self.via in ("cgroup", "shares"):
            return lambda: procs.write_text(str(os.getpid()))
        return None

    def close(self) -> None:
        for g in self.groups:
            if g.exists():
                g.rmdir()


def _finish(p: subprocess.Popen) -> str:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{p.args[-8:]} exited with {p.returncode}")
    return out


def _last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def run_layout(common: list[str], slow: Slowdown, weights: str, tokens: int) -> dict:
    from tandem.cluster.launcher import free_ports

    trace_dir = tempfile.mkdtemp(prefix="tandem-bench-placement-")
    peers = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    env = {**os.environ, "TANDEM_SECRET": secrets.token_hex(16)}
    procs = []
    for rank in (1, 0):
        argv = slow.argv(rank) + common + ["--role", "tp", "--peers", peers, "--rank", str(rank)]
        argv += ["--trace-dir", trace_dir, "--weights", weights]
        argv += ["--threads", str(slow.threads(rank))]
        procs.append(
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=slow.enter(rank)
            )
        )
    try:
        out = _last_json(_finish(procs[1]))
        _finish(procs[0])
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
    traces = [json.loads((Path(trace_dir) / f"rank{r}.json").read_text()) for r in (0, 1)]
    out.update(per_rank(traces, *out["span"], tokens))
    c, s = out["compute_ms"], out["shares"]
    out["timed_ratio"] = (c[1] / s[1]) / (c[0] / s[0])
    out["probe_ratio"] = out["gemv_gb_s"][0] / out["gemv_gb_s"][1]
    bw = out.get("balanced_weights")
    out["service_ratio"] = bw[0] / bw[1] if bw else float("nan")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="A B pairs (equal, auto), interleaved")
    p.add_argument("--slow-via", choices=["shares", "cgroup", "taskset"], default="shares")
    p.add_argument("--slow-quota", type=float, default=0.5, help="the slow rank's CPUs (cgroup)")
    p.add_argument("--ratio", type=float, default=2.0, help="fast / slow CFS weight (shares)")
    p.add_argument("--role", choices=["driver", "single", "tp"], default="driver")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--peers", default="")
    p.add_argument("--trace-dir", default="")
    p.add_argument("--weights", default="1,1")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    if args.role != "driver":
        import torch

        torch.set_num_threads(args.threads)
        out = role_single(args) if args.role == "single" else role_tp(args)
        if out is not None:
            print(json.dumps(out), flush=True)
        return 0

    from tandem.loaders.make import make_model_dir

    model = args.model or DEFAULT_DIR
    if not (model / "config.json").exists():
        print(f"writing the qwen3-0.6b preset to {model} ...", file=sys.stderr)
        make_model_dir(model, "qwen3-0.6b", seed=0)
    common = [sys.executable, __file__, "--model", str(model), "--dtype", args.dtype]
    common += ["--prompt-len", str(args.prompt_len), "--decode", str(args.decode)]
    print("single node ...", file=sys.stderr)
    single = subprocess.Popen(
        common + ["--role", "single", "--threads", "2"], stdout=subprocess.PIPE, text=True
    )
    ref_ids = _last_json(_finish(single))["token_ids"]

    slow = Slowdown(args.slow_via, args.slow_quota, args.ratio)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    try:
        for i in range(args.rounds):
            for name, weights in LAYOUTS.items():
                print(f"round {i + 1}: {name} ...", file=sys.stderr)
                r = run_layout(common, slow, weights, args.decode)
                r["same_greedy_ids"] = r.pop("token_ids") == ref_ids
                runs[name].append(r)
                print(json.dumps({"layout": name, **r}), file=sys.stderr)
    finally:
        slow.close()
    print(report(runs, args))
    return 0


def _med(rows: list[dict], key: str, i: int | None = None) -> float:
    return statistics.median(r[key] if i is None else r[key][i] for r in rows)


def balance_ratio(eq: list[dict], au: list[dict]) -> float:
    """The fast rank's share s at which its decode compute equals the slow rank's, from the
    medians of the two layouts (compute linear in s between them), as a weight ratio s / (1 - s)."""
    points = []
    for rows in (eq, au):
        s = statistics.median(r["shares"][0] for r in rows)
        gap = _med(rows, "compute_ms", 0) - _med(rows, "compute_ms", 1)  # fast - slow
        points.append((s, gap))
    (s0, g0), (s1, g1) = points
    s = s0 if g1 == g0 else s0 - g0 * (s1 - s0) / (g1 - g0)
    return s / (1 - s)


def marginal_costs(eq: list[dict], au: list[dict]) -> list[tuple[float, float]] | None:
    """Each rank's decode compute as a_r + b_r s_r (ms/token at plan share s_r), a line through
    the two layouts' medians: b_r is its time per unit of share (so b_slow / b_fast is the speed
    ratio net of fixed costs, what the probe measures), a_r its fixed cost per token (the head's
    sampling and scheduling, work every rank repeats). None where the shares did not move.
    Unstable where a rank's compute is not linear in its share: under a CFS quota a rank with a
    smaller share waits longer between its bursts and runs more of each at full speed (a loaded
    2-core run read a slow-rank intercept of -138 ms/token and a ratio of 6.9)."""
    out = []
    for r in (0, 1):
        s0 = statistics.median(x["shares"][r] for x in eq)
        s1 = statistics.median(x["shares"][r] for x in au)
        if abs(s1 - s0) < 0.02:
            return None
        c0, c1 = _med(eq, "compute_ms", r), _med(au, "compute_ms", r)
        b = (c1 - c0) / (s1 - s0)
        out.append((c0 - b * s0, b))
    return out


def report(runs: dict[str, list[dict]], args) -> str:
    """The side-by-side table and the verdicts (medians over the rounds)."""
    how = {
        "cgroup": f"slow rank under a {args.slow_quota} CPU quota (cgroup v1 cpu, {PERIOD_US} us period)",
        "shares": f"CFS weights {args.ratio * SHARE_UNIT:.0f} : {SHARE_UNIT} (cgroup v1 cpu.shares)",
        "taskset": "slow rank on core 0 alone with 1 thread, fast rank on cores 0,1 with 2 (taskset)",
    }[args.slow_via]
    lines = [f"two TP ranks, {how}; {args.rounds} rounds, A B interleaved, medians", ""]
    lines.append(
        "| layout | weights (fast, slow) | decode tok/s | compute ms/tok fast, slow "
        "| wait ms/tok fast, slow | probe ratio | timed ratio | greedy ids = single |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for name, rows in runs.items():
        w = rows[len(rows) // 2]["weights"]
        lines.append(
            f"| {name} | {w[0]:.2f}, {w[1]:.2f} | {_med(rows, 'decode_tok_s'):.2f} "
            f"| {_med(rows, 'compute_ms', 0):.1f}, {_med(rows, 'compute_ms', 1):.1f} "
            f"| {_med(rows, 'wait_ms', 0):.1f}, {_med(rows, 'wait_ms', 1):.1f} "
            f"| {_med(rows, 'probe_ratio'):.2f} | {_med(rows, 'timed_ratio'):.2f} "
            f"| {all(r['same_greedy_ids'] for r in rows)} |"
        )
    eq, au = runs["equal"], runs["auto"]
    timed = _med(eq, "timed_ratio")
    auto_ratio = statistics.median(r["weights"][0] / r["weights"][1] for r in au)
    balance = balance_ratio(eq, au)
    service = statistics.median(r["service_ratio"] for r in eq)
    wait_eq = statistics.median(sum(r["wait_ms"]) for r in eq)
    wait_au = statistics.median(sum(r["wait_ms"]) for r in au)
    lines += [
        "",
        f"auto weights' ratio {auto_ratio:.2f} vs the independently timed speed ratio {timed:.2f} "
        f"(equal split): {100 * (auto_ratio / timed - 1):+.0f}% (target within 20%)",
        f"the split that equalizes the ranks' decode compute (interpolated between the two "
        f"layouts' medians): fast / slow = {balance:.2f}; auto weights {100 * (auto_ratio / balance - 1):+.0f}% from it",
        f"the in-service balancing ratio (measured_balance, equal-split runs' median) "
        f"{service:.2f}: {100 * (service / balance - 1):+.0f}% from the interpolated balance",
        *_marginal_lines(eq, au, auto_ratio),
        f"wait per token, both ranks: equal {wait_eq:.1f} ms, auto {wait_au:.1f} ms "
        f"(auto/equal {wait_au / wait_eq:.2f})",
        f"decode tok/s auto/equal: {_med(au, 'decode_tok_s') / _med(eq, 'decode_tok_s'):.2f}",
    ]
    return "\n".join(lines)


def _marginal_lines(eq: list[dict], au: list[dict], auto_ratio: float) -> list[str]:
    costs = marginal_costs(eq, au)
    if costs is None:
        return ["(auto kept the equal split: no second point for the marginal speed ratio)"]
    (a0, b0), (a1, b1) = costs
    return [
        f"compute ms/token = a + b * share, fitted through both layouts: fast a {a0:.1f} b "
        f"{b0:.1f}, slow a {a1:.1f} b {b1:.1f}; marginal speed ratio b_slow / b_fast = "
        f"{b1 / b0:.2f}; auto weights {100 * (auto_ratio / (b1 / b0) - 1):+.0f}% from it"
    ]


if __name__ == "__main__":
    sys.exit(main())
