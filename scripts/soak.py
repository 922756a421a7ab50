"""A soak: mixed traffic against `tandem launch` or `tandem serve` on loopback, with periodic faults.

    .venv/bin/python scripts/soak.py [--model DIR | --preset tiny-qwen3] [--cmd launch|serve]
                                     [--tp 2] [--pp 1] [--minutes 30] [--faults 10]
                                     [--clients 4] [--heartbeat-timeout 2] [--op-timeout 60]
                                     [--json OUT]

Starts the server, takes each prompt's reference text from a greedy run of it alone, then for
`--minutes` runs `--clients` client threads, each looping over a random mix of
  stream  (60 %): a streamed greedy completion (EOS ignored, so its length is fixed);
  cancel  (20 %): the same, the connection closed after a few chunks;
  bad     (20 %): a malformed request (bad JSON, a negative max_tokens, a wrong type, ...).
Every `minutes / (faults + 1)` it sends SIGKILL or SIGSTOP (alternately) to a random worker or
stage process of the group, and records when /health turned 503 and when it was 200 again.

Each request is judged: a stream is "equal" (finished with its reference text), "error" (ended
with an error event or an HTTP error: a failure the client was told of), or "lost" (ended
without an error and not equal: cut off, or other text); a cancel is "ok" if what it read is a
prefix of its reference; a bad request is "refused" (4xx) or "mishandled" (anything else). The
RSS of the head (the serve process) and of the whole tree is sampled every 15 s; the report
gives the head's last and largest RSS as a ratio to its RSS after the first minute of traffic.
It prints a JSON summary on the last line and exits 1 if any request was lost, any bad request
mishandled, or the head's RSS grew by more than 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.fault_drill import health, served_model, worker_pids  # noqa: E402
from tandem.cluster.launcher import ProcessGroup, RankProcess, free_ports  # noqa: E402

PROMPTS = [
    ("Once upon a time", 48),
    ("The cat", 24),
    ("In a galaxy far away", 64),
    ("Hello", 16),
    ("Numbers: 1 2 3", 32),
    ("word " * 60 + "and then", 40),
]
BAD_BODIES = [
    b"{not json",
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "max_tokens": "many"}',
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": 17}',
    b"[]",
    b'{"prompt": "x", "max_tokens": 4, "echo": true}',
]
RSS_EVERY_S = 15.0


def _post(base: str, body: bytes, timeout: float = 600.0):
    req = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=timeout)


def stream(base: str, model: str, prompt: str, n: int, stop_after: int | None = None) -> dict:
    """One streamed greedy completion: {"text", "error", "finish", "cut"}; with `stop_after`, the
    connection is closed after that many chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    out = {"text": "", "error": None, "finish": None, "cut": False}
    chunks = 0
    try:
        with _post(base, json.dumps(body).encode()) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = str(event["error"].get("message"))
                for choice in event.get("choices", []):
                    out["text"] += choice.get("text") or ""
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    out["cut"] = True
                    break
    except urllib.error.HTTPError as e:
        out["error"] = f"HTTP {e.code}: {e.read()[:200]!r}"
    except (OSError, ValueError) as e:
        out["error"] = None  # a reset without an error event: judged by the caller
        out["reset"] = f"{type(e).__name__}: {e}"
    return out


def bad_request(base: str, body: bytes) -> str:
    try:
        with _post(base, body, timeout=30) as r:
            return f"accepted {r.status}"
    except urllib.error.HTTPError as e:
        return "refused" if 400 <= e.code < 500 else f"HTTP {e.code}"
    except OSError as e:
        return f"{type(e).__name__}"


class Soak:
    def __init__(self, base: str, model: str, refs: dict[str, str], until: float, seed: int):
        self.base, self.model, self.refs, self.until = base, model, refs, until
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.lost: list[dict] = []

    def judge(self, kind: str, prompt: str, got: dict) -> str:
        ref = self.refs[prompt]
        if kind == "cancel":
            return "ok" if ref.startswith(got["text"]) and not got.get("reset") else "lost"
        if got["error"] is not None:
            return "error"
        return "equal" if got["text"] == ref and got["finish"] == "length" else "lost"

    def client(self, i: int) -> None:
        rng = random.Random(self.rng.random())
        while time.monotonic() < self.until:
            roll = rng.random()
            if roll < 0.2:
                why = bad_request(self.base, rng.choice(BAD_BODIES))
                verdict = "refused" if why == "refused" else "mishandled"
                with self.lock:
                    self.counts[f"bad:{verdict}"] += 1
                    if verdict == "mishandled":
                        self.lost.append({"kind": "bad", "why": why})
                continue
            prompt, n = rng.choice(PROMPTS)
            kind = "cancel" if roll < 0.4 else "stream"
            got = stream(
                self.base, self.model, prompt, n, rng.randint(1, 4) if kind == "cancel" else None
            )
            verdict = self.judge(kind, prompt, got)
            with self.lock:
                self.counts[f"{kind}:{verdict}"] += 1
                if verdict == "lost":
                    self.lost.append({"kind": kind, "prompt": prompt[:30], **got})


def _server_pid(proc_pid: int, cmd: str) -> int:
    if cmd == "serve":
        return proc_pid
    for c in psutil.Process(proc_pid).children():
        if "serve" in c.cmdline():
            return c.pid
    raise RuntimeError("no `tandem serve` below `tandem launch`")


def _all_below(group: ProcessGroup) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(group.procs[0].pid).children(recursive=True)]
    except (psutil.Error, IndexError):
        return []


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--cmd", choices=("launch", "serve"), default="launch")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--op-timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    model = args.model
    if model is None:
        model = str(tmp / "model")
        subprocess.run(
            [sys.executable, "-m", "tandem", "make-model", model, "--preset", args.preset],
            check=True,
            capture_output=True,
        )
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tandem", args.cmd, "--model", model, "--tp", str(args.tp)]
    argv += ["--pp", str(args.pp), "--port", str(port), "--max-batch", str(args.clients)]
    argv += ["--op-timeout", str(args.op_timeout)]
    argv += ["--heartbeat-timeout", str(args.heartbeat_timeout), "--reform-timeout", "120"]
    if args.cmd == "launch":
        argv.append("--no-demo")
    group = ProcessGroup([RankProcess(args.cmd, argv, {})], log_dir=tmp / "logs")
    rng = random.Random(args.seed)
    faults: list[dict] = []
    rss: list[tuple[float, float, float]] = []  # (minutes in, head MB, tree MB)
    try:
        group.start()
        deadline = time.monotonic() + 600
        while health(base)[0] != 200:
            if group.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args.cmd} did not come up; see {tmp / 'logs'}")
            time.sleep(0.3)
        top = group.procs[0].pid
        server = _server_pid(top, args.cmd)
        name = served_model(base)
        refs = {}
        for p, n in PROMPTS:
            got = stream(base, name, p, n)
            if got["error"] or got.get("reset"):
                raise RuntimeError(f"the reference run of {p!r} failed: {got}")
            refs[p] = got["text"]
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        soak = Soak(base, name, refs, until, args.seed)
        clients = [
            threading.Thread(target=soak.client, args=(i,), daemon=True)
            for i in range(args.clients)
        ]
        for c in clients:
            c.start()
        every = args.minutes * 60 / (args.faults + 1)
        next_fault, next_rss = t0 + every, t0
        sigs = [signal.SIGKILL, signal.SIGSTOP]
        while time.monotonic() < until:
            now = time.monotonic()
            if now >= next_rss:
                tree = [top, server, *worker_pids(server)]
                rss.append((round((now - t0) / 60, 2), _rss_mb([server]), _rss_mb(tree)))
                next_rss = now + RSS_EVERY_S
            if now >= next_fault and len(faults) < args.faults:
                victims = worker_pids(server)
                sig = sigs[len(faults) % 2]
                if victims:
                    victim = rng.choice(victims)
                    os.kill(victim, sig)
                    row = {"at_min": round((now - t0) / 60, 2), "signal": sig.name, "pid": victim}
                    seen = whole = None
                    while time.monotonic() - now < 180:
                        code, detail = health(base)
                        if code != 200 and seen is None:
                            seen, row["why"] = time.monotonic() - now, detail[:160]
                        if code == 200 and seen is not None:
                            whole = time.monotonic() - now
                            break
                        time.sleep(0.1)
                    row.update(detect_s=seen and round(seen, 2), whole_s=whole and round(whole, 2))
                    faults.append(row)
                    print(json.dumps(row), flush=True)
                next_fault = now + every
            time.sleep(0.2)
        for c in clients:
            c.join(900)
    finally:
        for pid in _all_below(group):  # a stopped process would not see its SIGTERM
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        group.shutdown()
    warm = [r for r in rss if r[0] >= 1.0] or rss
    head0 = warm[0][1]
    summary = {
        "cmd": args.cmd,
        "tp": args.tp,
        "pp": args.pp,
        "minutes": args.minutes,
        "clients": args.clients,
        "faults": len(faults),
        "faults_reformed": sum(f["whole_s"] is not None for f in faults),
        "max_detect_s": max((f["detect_s"] or 0 for f in faults), default=None),
        "max_whole_s": max((f["whole_s"] or 0 for f in faults), default=None),
        "requests": dict(sorted(soak.counts.items())),
        "lost": len(soak.lost),
        "lost_examples": soak.lost[:5],
        "head_rss_mb_first_min": head0,
        "head_rss_mb_last": rss[-1][1],
        "head_rss_ratio_last": round(rss[-1][1] / head0, 3),
        "head_rss_ratio_max": round(max(r[1] for r in warm) / head0, 3),
        "tree_rss_mb_first_min": warm[0][2],
        "tree_rss_mb_last": rss[-1][2],
        "rss_samples": rss,
    }
    text = json.dumps(summary)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    grew = summary["head_rss_ratio_max"] > 1.10
    return 1 if soak.lost or grew else 0


if __name__ == "__main__":
    sys.exit(main())
