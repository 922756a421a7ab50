"""Where a torch-free prefill's time goes: one GGUF file, one PROMPT-token step on the LeanExecutor
(`tandem generate --device cpu`'s executor for a quantized or 16-bit file), each native call
timed by wrapping the numpy faces it goes through (`lean.ops`, `lean.linear.Linear`).

    .venv/bin/python scripts/bench/prefill_profile.py FILE.gguf [--threads 2] [--prompt 64]
                                                   [--repeats 3]

Prints, per kind of call (the q/k/v, o, gate/up and down projections by their weight's width,
the attention, the norms and RoPE, SwiGLU), the median over `repeats` prefills of its total
milliseconds and its share of the step; the remainder is Python between the calls (embedding,
the cache writes, residual adds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    from tandem.engine.executor import Step, StepSequence
    from tandem.engine.lean import lean_executor_for
    from tandem.kernels.lean import linear, model, ops

    ex = lean_executor_for(
        a.file, device="cpu", dtype="auto", max_batch=1, max_seq_len=a.prompt + 8, threads=a.threads
    )
    if ex is None:
        raise SystemExit(f"{a.file}: not a file the torch-free path runs")
    times: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrap(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                times[name if isinstance(name, str) else name(*args)] += time.perf_counter() - t0

        return wrap

    call = linear.Linear.__call__
    linear.Linear.__call__ = timed(lambda self, x, th: f"linear {self.out_features}", call)
    for name in ("rmsnorm", "norm_rope_", "silu_mul", "prefill_attention"):
        setattr(model.ops, name, timed(name, getattr(ops, name)))
    prompt = tuple(range(10, 10 + a.prompt))
    runs = []
    for i in range(a.repeats + 1):
        times.clear()
        t0 = time.perf_counter()
        ex.run(Step((StepSequence(0, prompt, 0),), greedy=True))
        total = time.perf_counter() - t0
        ex.release([0])
        if i:  # the first run pages the file in
            runs.append((total, dict(times)))
    total = statistics.median(r[0] for r in runs)
    print(f"{a.file.name}: prefill {a.prompt} tokens, {a.threads} threads, median of {a.repeats}")
    print(f"  total {total * 1e3:8.1f} ms  ({a.prompt / total:.1f} tok/s)")
    names = sorted({n for _, t in runs for n in t}, key=lambda n: -runs[0][1].get(n, 0))
    rest = total
    for n in names:
        ms = statistics.median(t.get(n, 0.0) for _, t in runs)
        rest -= ms
        print(f"  {n:22s} {ms * 1e3:8.1f} ms  {100 * ms / total:5.1f}%")
    print(f"  {'other (Python)':22s} {rest * 1e3:8.1f} ms  {100 * rest / total:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
