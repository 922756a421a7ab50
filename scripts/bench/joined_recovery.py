"""Detection, re-form and replay times when a worker of a `cluster join` group is lost.

    .venv/bin/python scripts/bench/joined_recovery.py [--model DIR | --preset tiny-qwen3]
                                                      [--ranks 2] [--victim 1] [--cycles 3]
                                                      [--streams 3] [--max-tokens 32]
                                                      [--signal KILL] [--op-timeout S]

Forms a TP group of `ranks` nodes from one join token on loopback (`tandem cluster init`, then
`tandem cluster join --rank R`: rank 0 serves with `--reform-timeout 120`, every other rank joins
with `--rejoin`), runs `streams` concurrent streaming greedy completions once without a fault (the
reference texts), then `cycles` times: the same streams, and once each has 4 chunks, the signal
to the worker process of rank `victim`. Per cycle, from the signal: when /health first said 503
(detect), when it said 200 again (re-formed: the worker's node started a new worker that claimed
the next epoch off the status board, it and any surviving worker loaded their shards, the head
kept its own), the first replayed token (resume), whether every text equals the reference, and
the epoch the board shows. JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.bench.fault_drill import health, run_drill  # noqa: E402
from tandem.cluster.launcher import (  # noqa: E402
    ProcessGroup,
    RankProcess,
    free_port_block,
    free_ports,
)

PROMPTS = ["Once upon a time", "The cat", "In a galaxy far away", "Hello", "Numbers: 1 2 3"]
TANDEM = [sys.executable, "-m", "tandem"]


def _cli(*args: str) -> str:
    out = subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args[:2])}: {out.stderr.strip()[-500:]}")
    return out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--victim", type=int, default=1, help="the rank whose worker is signalled")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--signal", default="KILL", help="KILL (a dead worker) or STOP (a hung one)")
    ap.add_argument("--op-timeout", type=float, default=None, help="the head's bound on a step")
    args = ap.parse_args()
    if not 1 <= args.victim < args.ranks:
        ap.error(f"--victim is a worker rank, 1..{args.ranks - 1}")
    sig = getattr(signal, f"SIG{args.signal}")
    tmp = Path(tempfile.mkdtemp(prefix="tandem-joined-recovery-"))
    model = args.model or str(tmp / "model")
    if args.model is None:
        _cli("make-model", model, "--preset", args.preset)
    base_port = free_port_block(args.ranks + 2)  # every rank's, the master's, the status board's
    hosts = ",".join(["127.0.0.1"] * args.ranks)
    token = _cli("cluster", "init", "--hosts", hosts, "--base-port", str(base_port), "--no-qr")
    token = token.split()[-1]
    (http,) = free_ports(1)
    base = f"http://127.0.0.1:{http}"
    ranks = []
    for r in range(args.ranks):
        argv = [*TANDEM, "cluster", "join", token, "--rank", str(r), "--model", model]
        argv += ["--config-dir", str(tmp / f"n{r}"), "--port", str(http)]
        if r == 0:
            argv += ["--reform-timeout", "120"]
            if args.op_timeout is not None:
                argv += ["--op-timeout", str(args.op_timeout)]
        else:
            argv.append("--rejoin")
        ranks.append(RankProcess(f"rank{r}", argv))
    group = ProcessGroup(ranks, log_dir=tmp / "logs")
    prompts = (PROMPTS * args.streams)[: args.streams]
    cycles, quiet = [], None
    try:
        group.start()
        deadline = time.monotonic() + 600
        while health(base)[0] != 200:
            if group.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not come up; see {tmp / 'logs'}")
            time.sleep(0.3)
        node = group.procs[args.victim].pid  # its `tandem worker` is the drill's victim
        quiet = run_drill(base, node, prompts, max_tokens=args.max_tokens, sig=None)
        ref = [s.text for s in quiet.streams]
        for i in range(args.cycles):
            d = run_drill(base, node, prompts, max_tokens=args.max_tokens, sig=sig)
            snap = json.loads(_cli("cluster", "status", token, "--json"))
            row = {
                "cycle": i + 1,
                "in_flight": d.in_flight_at_fault,
                "detect_s": d.detect_s,
                "reformed_s": d.whole_s,
                "resume_s": d.resume_s,
                "texts_equal": [s.text for s in d.streams] == ref,
                "errors": [s.error for s in d.streams if s.error],
                "epoch": snap["ranks"][0].get("epoch"),
            }
            cycles.append(row)
            print(json.dumps(row), flush=True)
    finally:
        group.shutdown()

    def med(key: str) -> float | None:
        vals = [c[key] for c in cycles if c[key] is not None]
        return round(statistics.median(vals), 3) if vals else None

    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "victim": args.victim,
                "signal": args.signal,
                "streams": args.streams,
                "cycles": len(cycles),
                "median_detect_s": med("detect_s"),
                "median_reformed_s": med("reformed_s"),
                "median_resume_s": med("resume_s"),
                "all_texts_equal": all(c["texts_equal"] for c in cycles),
                "last_epoch": cycles[-1]["epoch"] if cycles else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
