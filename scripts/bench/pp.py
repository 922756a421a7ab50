"""Pipeline parallelism vs single-node and TP=2: decode tok/s, TTFT, bytes on the wire per token, and
aggregate throughput of concurrent streams, measured side by side in one run.

    .venv/bin/python scripts/bench/pp.py [--model DIR] [--dtype float32] [--threads 1] [--prompt-len 64]
                                 [--decode 16] [--streams 4] [--repeats 2]

Without --model the `qwen3-0.6b` preset is written to /tmp/tandem-bench-qwen3-0.6b (once). Every
process (the single node, each TP rank, each stage) runs with --threads torch threads; on a shared
2-core machine the ranks of TP=2 and the stages of PP=2 compete for the same cores, so this measures
overhead, not speed-up (see BASELINES.md). Figures:

  - TTFT: wall time of the prefill step of one --prompt-len prompt (median of --repeats);
  - decode tok/s (1 stream): --decode tokens over the time of their decode steps (median);
  - wire bytes/token: bytes on the head's sockets during single-stream decode (PP: the hidden state
    to stage 1 and the last-token hidden state back, frame headers included; TP: the collectives'
    bytes moved by the head), against the target of one float32 hidden state per stage boundary;
  - aggregate tok/s (--streams streams): the streams decode together, one batched step per token,
    total new tokens over the decode time; under PP also pipelined (`generate_pipelined`: the
    streams in one group per stage, each group's next step submitted as soon as its token is
    sampled, so every stage works on a different group at once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.devices import DTYPE_NAMES
from tandem.engine.executor import Step, StepSequence
from tandem.engine.pp.generate import generate_pipelined
from tandem.engine.pp.launch import launch_pipeline
from tandem.engine.pp.layout import plan_stages
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tp.local import launch_local_tp
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir

DEFAULT_DIR = Path("/tmp/tandem-bench-qwen3-0.6b")


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, min(vocab, 4000), (length,), generator=g).tolist() for _ in range(n)]


def wire_bytes(ex) -> int:
    """Bytes the head has moved so far: its stage links (PP) or its collectives (TP)."""
    if hasattr(ex, "socket_bytes"):
        return ex.socket_bytes
    stats = getattr(ex, "comm_stats", None)
    return stats.bytes_moved if stats is not None else 0


def run_streams(ex, ps: list[list[int]], decode: int, base: int) -> dict:
    """Greedy prefill of every prompt together, then `decode` batched decode steps."""
    ids = [base + i for i in range(len(ps))]
    t0 = time.perf_counter()
    logits = ex.run(Step(tuple(StepSequence(i, tuple(p), 0) for i, p in zip(ids, ps)))).logits
    ttft = time.perf_counter() - t0
    pos = [len(p) for p in ps]
    b0 = wire_bytes(ex)
    t1 = time.perf_counter()
    for _ in range(decode):
        nxt = logits.argmax(-1).tolist()
        step = Step(tuple(StepSequence(i, (t,), q) for i, t, q in zip(ids, nxt, pos)))
        logits = ex.run(step).logits
        pos = [q + 1 for q in pos]
    dt = time.perf_counter() - t1
    moved = wire_bytes(ex) - b0
    ex.release(ids)
    return {"ttft": ttft, "tok_s": decode * len(ps) / dt, "bytes_tok": moved / (decode * len(ps))}


def run_pipelined(ex, ps: list[list[int]], decode: int, base: int) -> dict:
    """The same streams through `generate_pipelined`: one group per stage in flight."""
    params = SamplingParams(max_tokens=decode + 1, temperature=0.0)
    res = generate_pipelined(ex, ps, params, first_seq_id=base)
    start = min(r.ttft_s for r in res)
    end = max(r.ttft_s + r.decode_s for r in res)
    return {"tok_s": sum(len(r.token_ids) - 1 for r in res) / (end - start)}


def measure(name: str, ex, ps, a) -> dict:
    run_streams(ex, ps[:1], 2, base=1000)  # warm-up
    singles = [run_streams(ex, ps[:1], a.decode, base=10 * r) for r in range(a.repeats)]
    multi = [
        run_streams(ex, ps[: a.streams], a.decode, base=500 + 10 * r) for r in range(a.repeats)
    ]
    row = {
        "layout": name,
        "ttft": statistics.median(s["ttft"] for s in singles),
        "tok_s": statistics.median(s["tok_s"] for s in singles),
        "bytes_tok": statistics.median(s["bytes_tok"] for s in singles),
        "agg_tok_s": statistics.median(m["tok_s"] for m in multi),
    }
    if hasattr(ex, "submit"):
        piped = [
            run_pipelined(ex, ps[: a.streams], a.decode, base=800 + 10 * r)
            for r in range(a.repeats)
        ]
        row["piped_tok_s"] = statistics.median(m["tok_s"] for m in piped)
    print(
        f"{name:<12} TTFT {row['ttft']:.3f} s  decode {row['tok_s']:.2f} tok/s  "
        f"{a.streams} streams {row['agg_tok_s']:.2f} tok/s  wire {row['bytes_tok']:.0f} B/token"
        + (
            f"  {a.streams} streams pipelined {row['piped_tok_s']:.2f} tok/s"
            if "piped_tok_s" in row
            else ""
        ),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layouts", default="single,tp2,pp2")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model_dir = a.model or DEFAULT_DIR
    if not (model_dir / "config.json").exists():
        print(f"writing the qwen3-0.6b preset to {model_dir} ...", file=sys.stderr)
        make_model_dir(model_dir, "qwen3-0.6b", seed=0)
    cfg = ModelDir(model_dir).config
    seq = a.prompt_len + a.decode + 8
    ps = prompts(a.streams, a.prompt_len, cfg.vocab_size)
    print(
        f"model {model_dir} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}), {a.dtype}, "
        f"{a.threads} thread(s) per process, prompt {a.prompt_len}, decode {a.decode}, "
        f"median of {a.repeats}",
        flush=True,
    )
    rows = {}
    for layout in a.layouts.split(","):
        if layout == "single":
            from tandem.engine.local import LocalExecutor

            model = load_model(ModelDir(model_dir), dtype=DTYPE_NAMES[a.dtype])
            ex = LocalExecutor(model, max_batch=a.streams, max_seq_len=seq)
        elif layout == "tp2":
            ex = launch_local_tp(
                model_dir, 2, dtypes=[a.dtype] * 2, devices=["cpu"] * 2, max_batch=a.streams,
                max_seq_len=seq, threads=a.threads,
            )  # fmt: skip
        elif layout.startswith("pp"):
            stages = plan_stages(cfg, [1] * int(layout[2:]), dtype=a.dtype)
            print(f"  {layout} stages: " + ", ".join(f"{s.layers}" for s in stages), flush=True)
            ex = launch_pipeline(
                model_dir, stages, max_batch=a.streams, max_seq_len=seq, threads=a.threads
            )
        else:
            raise SystemExit(f"unknown layout {layout!r}")
        try:
            rows[layout] = measure(layout, ex, ps, a)
        finally:
            ex.close()
            del ex
    target = 2 * cfg.hidden_size * 4  # PP=2: one float32 hidden state across each of 2 boundaries
    print()
    print("| layout | TTFT s | decode tok/s (1 stream) | aggregate tok/s "
          f"({a.streams} streams, one batch) | pipelined ({a.streams} streams, a group per stage) "
          "| best agg / single | wire bytes/token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows.values():
        piped = r.get("piped_tok_s")
        best = max(r["agg_tok_s"], piped or 0.0)
        print(
            f"| {r['layout']} | {r['ttft']:.3f} | {r['tok_s']:.2f} | {r['agg_tok_s']:.2f} | "
            f"{f'{piped:.2f}' if piped else '-'} | {best / r['tok_s']:.2f}x | {r['bytes_tok']:.0f} |"
        )
    if "single" in rows:
        for k, r in rows.items():
            if k != "single":
                print(
                    f"{k}: decode {r['tok_s'] / rows['single']['tok_s']:.2f}x single-node, "
                    f"TTFT {r['ttft'] / rows['single']['ttft']:.2f}x"
                )
    if "pp2" in rows:
        r = rows["pp2"]
        print(
            f"pp2 wire: {r['bytes_tok']:.0f} B/token vs target {target} B (2 boundaries x hidden "
            f"{cfg.hidden_size} x 4 B) = {r['bytes_tok'] / target:.3f}x; "
            f"{a.streams} streams beat 1 stream: batched {r['agg_tok_s'] > r['tok_s']}, "
            f"pipelined {r.get('piped_tok_s', 0) > r['tok_s']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
