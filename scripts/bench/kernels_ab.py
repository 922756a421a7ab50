"""Whole-model decode and prefill on two builds of csrc/ in one process, interleaved: a git
revision's kernels (`--old`, default HEAD) and the working tree's, swapped under one loaded
model between rounds, so a busy machine slows both alike.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/kernels_ab.py [GGUF] [--old REV] [--threads 2]
                                                    [--rounds 7] [--prompt 64] [--tokens 32] [--lean]

GGUF defaults to the qwen3-0.6b Q4_0 file of vs_llamacpp.py; `--lean` runs the torch-free
LeanExecutor (`tandem generate --device cpu`'s path for quantized and 16-bit files) instead of
LocalExecutor. Per round and build: one prefill
step of `--prompt` tokens, then `--tokens` greedy decode tokens; prints the median tok/s of each
build and the median of the per-round new/old ratios, and whether the greedy ids agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH leaves it out
from qgemv_ab import DEFAULT, ROOT, checkout_csrc  # noqa: E402


def build_all(src: Path, out: Path, extra: str = ""):
    """csrc/ at `src` built as tandem.kernels.native builds it, every signature set."""
    import ctypes
    import subprocess

    from tandem.kernels import native

    srcs = [str(src / s.name) for s in native.SOURCES if (src / s.name).exists()]
    subprocess.run(
        [native._compiler(), *native.FLAGS, *extra.split(), "-o", str(out), *srcs, "-lm"],
        check=True,
    )
    lib = ctypes.CDLL(str(out))
    for name, (restype, argtypes) in native._SIGNATURES.items():
        fn = getattr(lib, name, None)  # an older revision may lack a newer function
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="?", default=str(DEFAULT))
    p.add_argument("--old", default="HEAD")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--old-flags", default="", help="extra compiler flags for the old build")
    p.add_argument("--new-flags", default="")
    p.add_argument("--lean", action="store_true", help="the torch-free LeanExecutor's path")
    a = p.parse_args()
    import torch

    from tandem.engine.executor import Step, StepSequence
    from tandem.engine.local import LocalExecutor
    from tandem.kernels import library, native

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="kernels-ab-"))
    libs = {
        "old": build_all(checkout_csrc(a.old, tmp / "old"), tmp / "old.so", a.old_flags),
        "new": build_all(ROOT / "tandem/kernels/csrc", tmp / "new.so", a.new_flags),
    }
    native.available()  # the module's own build, then swapped per round below
    seq = a.prompt + a.tokens + 8
    if a.lean:
        from tandem.engine.lean import lean_executor_for

        ex = lean_executor_for(
            a.gguf, device="cpu", dtype="auto", max_batch=1, max_seq_len=seq, threads=a.threads
        )
        if ex is None:
            raise SystemExit(f"{a.gguf}: not a file the torch-free path runs")
    else:
        ex = LocalExecutor.from_dir(a.gguf, max_batch=1, max_seq_len=seq)
    prompt = tuple(11 + (7 * i) % 1000 for i in range(a.prompt))

    def run(name: str) -> tuple[float, float, list[int]]:
        native._library = library._library = lambda: libs[name]  # both modules' lookups
        t0 = time.perf_counter()
        tok = int(ex.run(Step((StepSequence(0, prompt, 0),), greedy=True)).ids()[0])
        pre = a.prompt / (time.perf_counter() - t0)
        ids = [tok]
        t0 = time.perf_counter()
        for i in range(a.tokens):
            step = Step((StepSequence(0, (tok,), a.prompt + i),), greedy=True)
            tok = int(ex.run(step).ids()[0])
            ids.append(tok)
        dec = a.tokens / (time.perf_counter() - t0)
        ex.release([0])
        return pre, dec, ids

    run("old"), run("new")  # warm-up: the file's pages
    res: dict[str, list] = {"old": [], "new": []}
    for _ in range(a.rounds):
        for name in res:
            res[name].append(run(name))
    med = statistics.median
    for i, what in ((0, "prefill"), (1, "decode")):
        old, new = [r[i] for r in res["old"]], [r[i] for r in res["new"]]
        ratio = med(n / o for n, o in zip(new, old))
        print(
            f"{Path(a.gguf).name} threads {a.threads} {what}: old {med(old):.1f} tok/s, new "
            f"{med(new):.1f}, new/old {ratio:.2f} (best {max(old):.1f} / {max(new):.1f}; median "
            f"of {a.rounds} interleaved rounds)"
        )
    same = res["old"][0][2] == res["new"][0][2]
    print(f"greedy ids old == new: {same}")


if __name__ == "__main__":
    main()
