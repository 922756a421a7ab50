"""How long a long-lived tandem process takes to exit once it is told to stop, for one or more
source trees side by side (e.g. a checkout before and after a change), rounds interleaved.

    .venv/bin/python scripts/bench/stop_to_exit.py --tree /path/to/old --tree . [--rounds 3]
                                                  [--preset tiny-qwen3]

Every process started for a tree runs in it, with it on PYTHONPATH (a tree's `tandem/` is what
`python -c` and `python -m tandem` import). Per round and tree:
  worker      a head (a fresh Python process) forms a local TP=2 group (`launch_local_tp`), runs
              nothing, and times `close()`: STOP sent to the `tandem worker` until it has exited
  serve       `tandem serve` (one device): SIGTERM until the process has exited
  serve-tp2   `tandem serve --tp 2`: SIGTERM until the head (and so its worker) has exited
  serve-pp2   `tandem serve --pp 2`: SIGTERM until the head (and so its stages) has exited
Prints, per case and tree, the median over rounds of the wall seconds from the stop to the exit
and of the CPU seconds the stopped processes spent meanwhile; the medians as JSON on the last
line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

WORKER_CODE = """
import resource, sys, time, psutil
from tandem.engine.tp.local import launch_local_tp
ex = launch_local_tp(sys.argv[1], 2, threads=1)
time.sleep(0.5)
before = sum(sum(c.cpu_times()[:2]) for c in psutil.Process().children(recursive=True))
t0 = time.perf_counter()
ex.close()
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(wall, ru.ru_utime + ru.ru_stime - before)
"""


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and its descendants so far."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(proc.cpu_times()[:2])
    return total


def env_for(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_worker(tree: Path, model: Path) -> tuple[float, float]:
    done = subprocess.run(
        [sys.executable, "-c", WORKER_CODE, str(model)],
        env=env_for(tree),
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    wall, cpu = done.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def time_serve(tree: Path, model: Path, layout: list[str]) -> tuple[float, float]:
    """SIGTERM to exit of `tandem serve` once it says it is serving: wall seconds, and CPU seconds
    its process tree spent meanwhile."""
    argv = [sys.executable, "-m", "tandem", "serve", "--model", str(model)]
    argv += ["--port", str(free_port()), *layout]
    reaped = children_cpu()
    proc = subprocess.Popen(
        argv,
        env=env_for(tree),
        cwd=tree,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("tandem: web page at"):
                break
        else:
            raise RuntimeError(f"{argv} exited {proc.wait()} before serving")
        before = tree_cpu(proc.pid)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        return time.perf_counter() - t0, children_cpu() - reaped - before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, help="a source tree (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preset", default="tiny-qwen3")
    args = p.parse_args()
    trees = [Path(t).resolve() for t in args.tree]
    cases = {
        "worker": lambda tree, m: time_worker(tree, m),
        "serve": lambda tree, m: time_serve(tree, m, []),
        "serve-tp2": lambda tree, m: time_serve(tree, m, ["--tp", "2"]),
        "serve-pp2": lambda tree, m: time_serve(tree, m, ["--pp", "2"]),
    }
    times: dict[str, dict[str, list[tuple[float, float]]]] = {
        c: {str(t): [] for t in trees} for c in cases
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / args.preset
        subprocess.run(
            [sys.executable, "-m", "tandem", "make-model", str(model), "--preset", args.preset],
            env=env_for(ROOT),
            check=True,
            capture_output=True,
        )
        for r in range(args.rounds):
            for case, fn in cases.items():
                for tree in trees:
                    wall, cpu = fn(tree, model)
                    times[case][str(tree)].append((wall, cpu))
                    print(f"round {r} {case:10s} {tree}: {wall:.3f} s, CPU {cpu:.3f} s", flush=True)
    result: dict[str, dict[str, dict[str, float]]] = {}
    for case, per_tree in times.items():
        result[case] = {
            t: {
                "wall_s": statistics.median(w for w, _ in v),
                "cpu_s": statistics.median(c for _, c in v),
            }
            for t, v in per_tree.items()
        }
        line = "  ".join(
            f"{t}: {m['wall_s']:.3f} s (CPU {m['cpu_s']:.3f} s)" for t, m in result[case].items()
        )
        print(f"{case:10s} {line}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
