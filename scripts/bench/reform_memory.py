"""The TP head's memory across re-forms: a local `--tp 2` serving engine (as `tandem serve --tp 2`
builds it, re-form on), its worker SIGKILLed `--faults` times; after each re-form (and a few
requests) the head's RSS, and with `--trace` what Python allocated that it still holds.

    .venv/bin/python scripts/bench/reform_memory.py [--faults 5] [--tp 2] [--trace]

Prints one line per re-form (RSS in MB, the re-forms counted by the executor) and, with
`--trace`, the largest tracemalloc differences (by traceback) between the state after the first
re-form and after the last: what each re-form keeps in Python objects. Each snapshot is written
to a file and dropped at once, and both are read back only at the end: a snapshot is a copy of
every trace (25 frames each) as Python objects that tracemalloc builds untraced, so neither of its
figures counts them, and each one held stays in the RSS (~320 MB here). This script once kept
them all, which read as 849 -> 1,174 -> 1,577 MB over two re-forms while both figures were flat.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import signal
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import psutil

PROMPT = list(range(1, 30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--trace", action="store_true", help="tracemalloc diffs between re-forms")
    args = ap.parse_args()
    if args.trace:
        tracemalloc.start(25)
    from tandem.cli.engine_factory import build_serving_engine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.loaders.make import make_model_dir

    model = Path(tempfile.mkdtemp(prefix="reform-mem-")) / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    # traced, a gc pass or a snapshot is one C call that holds the GIL for seconds on a loaded
    # machine, long enough to starve the head's heartbeat thread: the worker would take the head
    # for hung and leave on its own (PEER_LOST_EXIT), so a traced run beats on a longer timeout
    heartbeat = 30.0 if args.trace else 2.0
    engine, close = build_serving_engine(
        model, tp=args.tp, max_seq_len=256, op_timeout=60, heartbeat_timeout=heartbeat,
        reform_timeout=60,
    )  # fmt: skip

    def request() -> None:
        done, out = threading.Event(), {}
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        engine.generate(
            PROMPT, params, (), lambda d: None, lambda c, e: (out.update(e=e), done.set())
        )
        if not done.wait(120) or out["e"] is not None:
            raise SystemExit(f"a request failed: {out.get('e')}")

    def workers() -> list[psutil.Process]:
        kids = psutil.Process().children(recursive=True)
        return [c for c in kids if "worker" in c.cmdline()]

    snaps: list[Path] = []
    snap_dir = Path(tempfile.mkdtemp(prefix="reform-mem-snap-"))
    try:
        for i in range(args.faults + 1):
            if i:
                for w in workers():
                    w.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                while engine.health()[0] and time.monotonic() - t0 < 30:
                    time.sleep(0.05)
            for _ in range(4):
                request()  # the first after a fault waits for the re-form and replays
            gc.collect()
            rss = psutil.Process().memory_info().rss / 1e6
            reforms = engine.scheduler.executor.counts.reforms
            line = f"after fault {i}: head RSS {rss:.1f} MB, re-forms {reforms}"
            if args.trace:
                traced = tracemalloc.get_traced_memory()[0] / 1e6
                own = tracemalloc.get_tracemalloc_memory() / 1e6
                line += f", Python-allocated {traced:.2f} MB, tracemalloc's own {own:.1f} MB"
                if i:  # after the first re-form and the latest, on disk, not in this process
                    path = snap_dir / f"after-{1 if i == 1 else 'last'}.snapshot"
                    snap = tracemalloc.take_snapshot()
                    snap.dump(str(path))
                    del snap
                    gc.collect()
                    snaps[0 if i == 1 else 1 :] = [path]
            print(line, flush=True)
    finally:
        close()
    tracemalloc.stop()  # the diff's own objects untraced: reading two snapshots back is slow
    if len(snaps) == 2:
        keep = [tracemalloc.Filter(False, tracemalloc.__file__)]
        first, last = (tracemalloc.Snapshot.load(str(p)).filter_traces(keep) for p in snaps)
        diff = last.compare_to(first, "traceback")
        total = sum(d.size_diff for d in diff)
        print(f"Python allocations held, re-form 1 -> {args.faults}: {total / 1e3:+.1f} kB")
        for d in diff[:8]:
            print(f"{d.size_diff / 1e3:+.1f} kB {d.count_diff:+d} blocks at")
            for line in d.traceback.format()[-6:]:
                print("   ", line)
    shutil.rmtree(snap_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
