"""Detection, re-form and replay times when a TP worker is killed under `tandem launch`.

    .venv/bin/python scripts/bench/recovery.py [--model DIR | --preset tiny-qwen3] [--tp 2] [--pp 1]
                                               [--streams 4] [--max-tokens 96] [--cycles 3]
                                               [--signal KILL] [--op-timeout S] [--prompt-words 0]
                                               [--heartbeat-timeout S]
                                               [--reload-head]

Starts `tandem launch --tp N --pp M` on loopback, runs `streams` concurrent streaming greedy completions
once without a fault (the reference texts), then `cycles` times: the same streams, and once each
has 4 chunks, the signal to one worker. Per cycle it prints, from the signal: when /health first
said 503 (detect), when it said 200 again (re-formed: a new worker started, its shard loaded, the
ring formed under a new epoch), when the first replayed token reached a client (resume), when
every stream had finished, each stream's longest silence against `fault_drill.pause_bound`, and
whether every text equals the reference; and the run without a
fault's time to first text (what a replay's prefill is to be compared with), and the CPU seconds
the head (serve) process used over each cycle (its share of the re-form: a kept shard or a
reloaded one, plus the same decode and replay either way). JSON on the last line.
`--prompt-words N` prefixes each prompt with N words, to time the replay of a long context.
`--reload-head`: the head reloads its own shard at each re-form instead of keeping it (A/B).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.bench.fault_drill import health, pause_bound, run_drill, worker_pids  # noqa: E402
from tandem.cluster.launcher import ProcessGroup, RankProcess, free_ports  # noqa: E402
from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S  # noqa: E402

PROMPTS = ["Once upon a time", "The cat", "In a galaxy far away", "Hello", "Numbers: 1 2 3"]


def _server_pid(launch_pid: int) -> int:
    for c in psutil.Process(launch_pid).children():
        if "serve" in c.cmdline():
            return c.pid
    raise RuntimeError("no `tandem serve` below `tandem launch`")


def _cpu_s(pid: int) -> float:
    """The CPU seconds (user + system) process `pid` has used so far."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _tree_rss_mb(launch_pid: int, server: int) -> dict[str, float]:
    """RSS of every process of the cluster: launch, the head (serve), each worker (by position:
    a replaced worker is a new process in the same place)."""
    out = {"launch": psutil.Process(launch_pid).memory_info().rss}
    out["head"] = psutil.Process(server).memory_info().rss
    for i, pid in enumerate(sorted(worker_pids(server))):
        out[f"worker{i + 1}"] = psutil.Process(pid).memory_info().rss
    return {k: round(v / 2**20, 1) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--op-timeout", type=float, default=None, help="bound on a hung rank (STOP)")
    ap.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="launch's --heartbeat-timeout: how soon a hung rank (STOP) is seen (0: off)",
    )
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--signal", default="KILL", help="KILL (a dead worker) or STOP (a hung one)")
    ap.add_argument("--prompt-words", type=int, default=0)
    ap.add_argument(
        "--reload-head",
        action="store_true",
        help="the head reloads its shard at each re-form (TANDEM_REFORM_RELOAD=1), as before it "
        "kept it: the A side of an A/B",
    )
    args = ap.parse_args()
    sig = getattr(signal, f"SIG{args.signal}")
    # the bound a hung rank is seen within: the heartbeat timeout (launch's default where not
    # given), or the op timeout where heartbeats are off (0)
    heartbeat = DEFAULT_HEARTBEAT_TIMEOUT_S
    if args.heartbeat_timeout is not None:
        heartbeat = args.heartbeat_timeout or (args.op_timeout or 60.0)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-recovery-"))
    model = args.model
    if model is None:
        import subprocess

        model = str(tmp / "model")
        subprocess.run(
            [sys.executable, "-m", "tandem", "make-model", model, "--preset", args.preset],
            check=True,
            capture_output=True,
        )
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tandem", "launch", "--model", model, "--tp", str(args.tp)]
    argv += ["--pp", str(args.pp), "--port", str(port), "--no-demo"]
    argv += ["--max-batch", str(max(args.streams, 1))]
    if args.op_timeout is not None:
        argv += ["--op-timeout", str(args.op_timeout)]
    if args.heartbeat_timeout is not None:
        argv += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    env = {"TANDEM_REFORM_RELOAD": "1"} if args.reload_head else {}
    group = ProcessGroup([RankProcess("launch", argv, env)], log_dir=tmp / "logs")
    prefix = " ".join(["word"] * args.prompt_words)
    prompts = [f"{prefix} {p}".strip() for p in (PROMPTS * args.streams)[: args.streams]]
    cycles = []
    baseline_rss_mb = None
    baseline_tree: dict[str, float] = {}
    quiet = None
    try:
        group.start()
        deadline = time.monotonic() + 600
        while health(base)[0] != 200:
            if group.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"launch did not come up; see {tmp / 'logs'}")
            time.sleep(0.3)
        server = _server_pid(group.procs[0].pid)
        quiet = run_drill(base, server, prompts, max_tokens=args.max_tokens, sig=None)
        ref = [s.text for s in quiet.streams]
        if any(s.error for s in quiet.streams):
            raise RuntimeError(f"the run without a fault failed: {quiet.streams[0].error}")
        baseline_rss_mb = round(psutil.Process(server).memory_info().rss / 2**20, 1)
        baseline_tree = _tree_rss_mb(group.procs[0].pid, server)
        for i in range(args.cycles):
            cpu0 = _cpu_s(server)
            d = run_drill(base, server, prompts, max_tokens=args.max_tokens, sig=sig)
            row = {
                "cycle": i + 1,
                "in_flight": d.in_flight_at_fault,
                "detect_s": d.detect_s,
                "reformed_s": d.whole_s,
                "resume_s": d.resume_s,
                "done_s": d.done_s,
                # each stream's longest silence across the fault, and what it may be: the
                # heartbeat's bound + this re-form + a replay (`fault_drill.pause_bound`)
                "max_pause_s": round(max(d.pauses), 2) if d.pauses else None,
                "pause_bound_s": round(pause_bound(d, quiet, heartbeat), 2)
                if d.detect_s is not None and d.whole_s is not None
                else None,
                "texts_equal": [s.text for s in d.streams] == ref,
                "errors": [s.error for s in d.streams if s.error],
                "head_rss_mb": round(psutil.Process(server).memory_info().rss / 2**20, 1),
                "head_cpu_s": round(_cpu_s(server) - cpu0, 2),
                "rss_mb": _tree_rss_mb(group.procs[0].pid, server),
            }
            cycles.append(row)
            print(json.dumps(row), flush=True)
    finally:
        group.shutdown()

    def med(key: str) -> float | None:
        vals = [c[key] for c in cycles if c[key] is not None]
        return round(statistics.median(vals), 3) if vals else None

    summary = {
        "tp": args.tp,
        "pp": args.pp,
        "signal": args.signal,
        "streams": args.streams,
        "prompt_words": args.prompt_words,
        "head_shard": "reloaded" if args.reload_head else "kept",
        "cycles": len(cycles),
        "median_detect_s": med("detect_s"),
        "median_reformed_s": med("reformed_s"),
        "median_resume_s": med("resume_s"),
        "median_head_cpu_s": med("head_cpu_s"),
        "quiet_ttft_s": round(quiet.ttft_s, 3) if quiet and quiet.ttft_s else None,
        "all_texts_equal": all(c["texts_equal"] for c in cycles),
        "head_rss_mb_baseline": baseline_rss_mb,
        "head_rss_mb_last": cycles[-1]["head_rss_mb"] if cycles else None,
        # every process: its RSS after the quiet run, after the last cycle, and the ratio
        "rss_mb_baseline": baseline_tree if cycles else None,
        "rss_mb_last": cycles[-1]["rss_mb"] if cycles else None,
        "rss_ratio_last": {
            k: round(v / baseline_tree[k], 3)
            for k, v in cycles[-1]["rss_mb"].items()
            if k in baseline_tree and baseline_tree[k]
        }
        if cycles
        else None,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
