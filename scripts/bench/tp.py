"""Tensor parallelism vs single-node on the `qwen3-0.6b` preset, side by side in one run: peak
resident memory per rank, TTFT, prefill and decode tok/s, and the synchronization per token.

    .venv/bin/python scripts/bench/tp.py [--model DIR] [--dtype float32] [--prompt-len 64] [--decode 16]
                                 [--rounds 2] [--single-threads 2] [--tp-threads 1]

Without --model the preset is written to /tmp/tandem-bench-qwen3-0.6b (once). Every measured
process is a child of this script: the single node, then the TP=2 head (rank 0) and its worker
(rank 1) on the loopback ring, once per `--transports` entry: `shm` (the default a local launch
gets: small all-reduces swap through same-host shared memory) and `tcp` (TANDEM_SHM=0: every byte
through the loopback TCP stack, as between hosts). Each child's peak RSS is its own `ru_maxrss`
from `wait4`; the top-level TP=2 figures are the first transport's.

Figures (each the best of --rounds greedy generations, EOS ignored):
  - TTFT: the prefill step of a --prompt-len prompt plus the first argmax;
  - prefill tok/s: prompt tokens / TTFT;  decode tok/s: 1 / median decode step;
  - collectives and bytes on the wire per decode token (MeteredCommunicator, group total);
  - synchronization ms/token: every rank records (enter, exit) of every collective on one
    CLOCK_MONOTONIC; per collective, sync = first exit - last entry (the collective itself:
    staging, wire, reduction, no waiting for a slower rank), summed over the decode phase / tokens;
    waiting for the other rank (skew) is reported apart. Target: sync <= 3 ms/token at TP=2.
On a 2-core machine the two ranks share the cores (see BASELINES.md): TP shows its overhead here,
not a speed-up. The ratios are measured in this run; absolute figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_DIR = Path("/tmp/tandem-bench-qwen3-0.6b")
TARGET_RSS_RATIO = 0.6
TARGET_SYNC_MS = 3.0


# ------------------------------------------------------------------------------- child roles


def _timed_run(executor, args, trace=None, metered=None) -> dict:
    from tandem.bench.timing import prompt_ids, time_greedy

    prompt = prompt_ids(args.prompt_len, executor.vocab_size)
    time_greedy(executor, prompt[:8], 2, seq_id=1)  # warm-up
    rounds, spans, comm = [], [], []
    for _ in range(args.rounds):
        marks = {}

        def phase(name: str, marks=marks) -> None:
            marks[name] = (
                len(trace.ops) if trace is not None else 0,
                metered.stats.copy() if metered is not None else None,
            )

        rounds.append(time_greedy(executor, prompt, args.decode, seq_id=0, on_phase=phase))
        spans.append([marks["decode_start"][0], marks["decode_end"][0]])
        if metered is not None:
            d = marks["decode_end"][1].minus(marks["decode_start"][1])
            comm.append(
                {
                    "collectives_per_token": d.collectives / args.decode,
                    "bytes_per_token": d.bytes_moved / args.decode,
                    "ms_in_collectives_per_token": 1000 * d.seconds / args.decode,
                }
            )
    best = min(range(len(rounds)), key=lambda i: rounds[i].decode_s_per_token)
    rss_now = _vm_rss()
    t = rounds[best]
    return {
        "ttft_s": min(r.ttft_s for r in rounds),
        "prefill_tok_s": max(r.prefill_tok_per_s for r in rounds),
        "decode_tok_s": t.decode_tok_per_s,
        "decode_rounds_s": [r.decode_s_per_token for r in rounds],
        "best_round": best,
        "decode_spans": spans,
        "comm": comm[best] if comm else None,
        "token_ids": list(t.token_ids),
        "rss_after_run": rss_now,
    }


def _vm_rss() -> int:
    """This process's resident bytes now (after loading and generating; file mappings included)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def role_single(args) -> dict:

    from tandem.devices import DTYPE_NAMES
    from tandem.engine.local import LocalExecutor

    ex = LocalExecutor.from_dir(
        args.model, dtype=DTYPE_NAMES[args.dtype], max_batch=2, max_seq_len=args.max_seq_len
    )
    return _timed_run(ex, args)


def role_tp(args) -> dict | None:
    from tandem.bench.optrace import TracedCommunicator
    from tandem.cli.worker import parse_peers, ring_from_args
    from tandem.comm.metered import MeteredCommunicator
    from tandem.engine.tp.setup import run_worker, start_head

    ring = ring_from_args(
        args.rank,
        2,
        parse_peers(args.peers, 2),
        os.environ["TANDEM_SECRET"].encode(),
        op_timeout=300.0,
        handshake_timeout=300.0,
        cluster_id="tandem-bench-tp",
    )
    metered = MeteredCommunicator(ring)
    trace = TracedCommunicator(metered)
    if args.rank != 0:
        try:
            run_worker(args.model, trace, dtype=args.dtype, device="cpu")
        finally:
            trace.dump(Path(args.trace_dir) / f"rank{args.rank}.json")
        return None
    ex = start_head(args.model, trace, max_batch=2, max_seq_len=args.max_seq_len, dtype=args.dtype)
    try:
        out = _timed_run(ex, args, trace, metered)
    finally:
        ex.close()
        trace.dump(Path(args.trace_dir) / "rank0.json")
    return out


# ------------------------------------------------------------------------------- the driver


def _spawn(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    """Peak RSS (bytes) of the child, from its own rusage, and its stdout."""
    out = p.stdout.read() if p.stdout else ""
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{p.args[3:6]} exited with {p.returncode}")
    return usage.ru_maxrss * 1024, out


def _last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


TRANSPORTS = {
    "shm": "the loopback ring, small all-reduces through same-host shared memory",
    "tcp": "the loopback ring, TCP only (TANDEM_SHM=0)",
}


def _run_tp(common: list[str], args, transport: str) -> dict:
    """One TP=2 run (head and worker processes): its figures, each rank's peak RSS, and the
    synchronization analysed from both ranks' traces over the best round's decode."""
    from tandem.bench.optrace import analyze_traces
    from tandem.cluster.launcher import free_ports

    trace_dir = tempfile.mkdtemp(prefix="tandem-bench-tp-")
    peers = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    env = {"TANDEM_SECRET": secrets.token_hex(16), "TANDEM_SHM": "1" if transport == "shm" else "0"}
    tp_args = ["--role", "tp", "--peers", peers, "--trace-dir", trace_dir]
    tp_args += ["--threads", str(args.tp_threads)]
    worker = _spawn(common + tp_args + ["--rank", "1"], env)
    head = _spawn(common + tp_args + ["--rank", "0"], env)
    try:
        rss_head, out = _finish(head)
        rss_worker, _ = _finish(worker)
    finally:
        for proc in (head, worker):
            if proc.returncode is None:
                proc.kill()
    tp = _last_json(out)
    traces = [json.loads((Path(trace_dir) / f"rank{r}.json").read_text()) for r in (0, 1)]
    start, end = tp["decode_spans"][tp["best_round"]]
    return {"tp": tp, "rss": (rss_head, rss_worker), "sync": analyze_traces(traces, start, end)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--single-threads", type=int, default=2)
    p.add_argument("--tp-threads", type=int, default=1)
    p.add_argument("--role", choices=["driver", "single", "tp"], default="driver")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--peers", default="")
    p.add_argument("--trace-dir", default="")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--transports", default="shm,tcp", help="TP=2 runs, in order: shm, tcp")
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
    common += ["--rounds", str(args.rounds), "--max-seq-len", str(args.max_seq_len)]

    print("single node ...", file=sys.stderr)
    rss_single, out = _finish(
        _spawn(common + ["--role", "single", "--threads", str(args.single_threads)])
    )
    single = _last_json(out)

    runs = {}
    for transport in args.transports.split(","):
        if transport not in TRANSPORTS:
            p.error(f"--transports: {transport!r} is not one of {sorted(TRANSPORTS)}")
        print(f"TP=2 over {TRANSPORTS[transport]} ...", file=sys.stderr)
        runs[transport] = _run_tp(common, args, transport)
    first = next(iter(runs.values()))
    tp, rss_head, rss_worker, sync = first["tp"], first["rss"][0], first["rss"][1], first["sync"]
    tokens = args.decode

    report = {
        "model": str(model),
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_len,
        "decode_tokens": tokens,
        "threads": {"single": args.single_threads, "tp_per_rank": args.tp_threads},
        "single": {k: single[k] for k in ("ttft_s", "prefill_tok_s", "decode_tok_s")},
        "tp2": {k: tp[k] for k in ("ttft_s", "prefill_tok_s", "decode_tok_s")},
        "peak_rss_mib": {
            "single": rss_single / 2**20,
            "tp2_rank0": rss_head / 2**20,
            "tp2_rank1": rss_worker / 2**20,
        },
        "rss_ratio_per_rank": [rss_head / rss_single, rss_worker / rss_single],
        "rss_after_run_mib": {
            "single": single["rss_after_run"] / 2**20,
            "tp2_rank0": tp["rss_after_run"] / 2**20,
        },
        "rss_after_run_ratio_rank0": tp["rss_after_run"] / single["rss_after_run"],
        "tp2_comm_per_token": tp["comm"],
        "tp2_sync_ms_per_token": 1000 * sync["sync_s"] / tokens,
        "tp2_wait_for_peer_ms_per_token": 1000 * sync["skew_s"] / tokens,
        "tp2_sync_by_kind_ms_per_token": {
            k: 1000 * v["sync_s"] / tokens for k, v in sync["by_kind"].items()
        },
        "decode_slowdown_tp2_vs_single": single["decode_tok_s"] / tp["decode_tok_s"],
        "same_greedy_ids": single["token_ids"] == tp["token_ids"],
    }
    report["tp2_transport"] = next(iter(runs))
    report["tp2_by_transport"] = {
        name: {
            "over": TRANSPORTS[name],
            "decode_tok_s": run["tp"]["decode_tok_s"],
            "sync_ms_per_token": 1000 * run["sync"]["sync_s"] / tokens,
            "wait_for_peer_ms_per_token": 1000 * run["sync"]["skew_s"] / tokens,
            "collectives_per_token": run["tp"]["comm"].get("collectives_per_token"),
            "same_greedy_ids": single["token_ids"] == run["tp"]["token_ids"],
        }
        for name, run in runs.items()
    }
    report["targets"] = {
        "rss_ratio_max": TARGET_RSS_RATIO,
        "rss_ok": max(report["rss_ratio_per_rank"]) <= TARGET_RSS_RATIO,
        "sync_ms_max": TARGET_SYNC_MS,
        "sync_ok": {
            name: row["sync_ms_per_token"] <= TARGET_SYNC_MS
            for name, row in report["tp2_by_transport"].items()
        },
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
