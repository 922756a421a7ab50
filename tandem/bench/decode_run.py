"""One rank of a timed generation: the head times it, the other ranks serve their part.

    python -m tandem.bench.decode_run --model DIR --layout single
    python -m tandem.bench.decode_run --model DIR --layout tp --rank R --world N --peers A:P,...
    python -m tandem.bench.decode_run --model DIR --layout pp --rank R --world M --peers A:P,...

The head (rank 0) prints "MARK decode_start" / "MARK decode_end" on stdout around the decode
phase of each of `--rounds` generations and waits for a line on stdin after each (so the harness
can read the network's byte counters exactly there), then prints one JSON object: the best round's
median decode step, the best TTFT and prefill speed, every round's figures, and the greedy ids. Ranks are placed on hosts by the harness; a peer address is the
rank's own host's address, which it binds.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from tandem.bench.timing import prompt_ids, time_greedy
from tandem.devices import DTYPE_NAMES


class DecodeRunError(RuntimeError):
    """A layout this build cannot launch, or bad peer arguments."""


def _phase_gate(name: str) -> None:
    print(f"MARK {name}", flush=True)
    sys.stdin.readline()


def _single(args: argparse.Namespace):
    from tandem.engine.build import Layout, Limits, build_executor

    layout = Layout(dtypes=(DTYPE_NAMES[args.dtype],))
    return build_executor(args.model, layout, Limits(2, args.max_seq_len)), None


def _tp(args: argparse.Namespace):
    """This rank of a TP group: the head's executor (built by `build_executor` over the traced
    group) and its traced communicator (on a worker, after the group closed: None, None)."""
    from tandem.bench.optrace import TracedCommunicator
    from tandem.comm.peers import connect_ring
    from tandem.engine.build import BuildHooks, Layout, Limits, build_executor
    from tandem.engine.tp.setup import run_worker

    comm = TracedCommunicator(
        connect_ring(args.rank, args.world, args.peers.split(","), args.secret)
    )
    if args.rank != 0:
        try:
            run_worker(args.model, comm, dtype=args.dtype, device="cpu")
        finally:
            if args.trace_dir:
                comm.dump(Path(args.trace_dir) / f"rank{args.rank}.json")
        return None, None
    layout = Layout(stage_tp=(args.world,), dtypes=(DTYPE_NAMES[args.dtype],), moe=args.moe)
    limits = Limits(2, args.max_seq_len)
    return build_executor(args.model, layout, limits, BuildHooks(comm=comm)), comm


def _pp(args: argparse.Namespace):
    """The head of an M-stage pipeline, one rank per stage, built by `build_executor` (it starts
    stages 1..M-1 itself) on the hosts `--netns` names (rank g inside namespace g), bound to
    their `--peers` addresses."""
    from tandem.comm.peers import parse_peers
    from tandem.engine.build import BuildHooks, Layout, Limits, build_executor

    addrs = [h for h, _ in parse_peers(args.peers.split(","))]
    netns = [n for n in args.netns.split(",") if n]
    if len(addrs) != args.world or (netns and len(netns) != args.world):
        raise DecodeRunError(f"pp: need {args.world} peers (and namespaces, if any)")
    prefix = (lambda g: ["ip", "netns", "exec", netns[g]]) if netns else None
    layout = Layout(
        stage_tp=(1,) * args.world, dtypes=(DTYPE_NAMES[args.dtype],), threads=args.threads
    )
    hooks = BuildHooks(addresses=addrs, argv_prefix=prefix)
    return build_executor(args.model, layout, Limits(2, args.max_seq_len), hooks), None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.decode_run")
    p.add_argument("--model", required=True)
    p.add_argument("--layout", choices=["single", "tp", "pp"], default="single")
    p.add_argument("--moe", choices=["tp", "experts"], default="tp", help="tp: expert placement")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--peers", default="", help="every rank's ADDR:PORT, in rank order")
    p.add_argument("--secret", default="")
    p.add_argument("--netns", default="", help="pp: every rank's namespace, in rank order")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="timed generations; the best is reported")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--gate", action="store_true", help="wait on stdin at the phase marks")
    p.add_argument("--trace-dir", default="", help="tp: every rank writes its collectives' times")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    build = {"single": _single, "tp": _tp, "pp": _pp}[args.layout]
    executor, trace = build(args)
    if executor is None:  # a worker: it served until the head closed the group
        return 0
    try:
        prompt = prompt_ids(args.prompt_len, executor.vocab_size)
        time_greedy(executor, prompt[: max(1, args.prompt_len // 4)], args.warmup, seq_id=1)
        spans: list[list[int]] = []

        def gate(name: str) -> None:
            if trace is not None:  # collective indices of the decode phase
                if name == "decode_start":
                    spans.append([len(trace.ops)])
                else:
                    spans[-1].append(len(trace.ops))
            if args.gate:
                _phase_gate(name)

        rounds = [
            time_greedy(executor, prompt, args.decode, seq_id=0, on_phase=gate)
            for _ in range(args.rounds)
        ]
    finally:
        executor.close()
        if trace is not None and args.trace_dir:
            trace.dump(Path(args.trace_dir) / "rank0.json", {"decode_spans": spans})
    # the best round: on a machine shared with other work, the least disturbed one
    best = min(rounds, key=lambda t: t.decode_s_per_token)
    kernels = getattr(executor, "kernels", None)  # a LocalExecutor's KernelReport
    out = {**asdict(best), "prefill_tok_per_s": max(t.prefill_tok_per_s for t in rounds),
           "ttft_s": min(t.ttft_s for t in rounds), "decode_tok_per_s": best.decode_tok_per_s,
           "rounds_decode_s_per_token": [t.decode_s_per_token for t in rounds],
           "rounds_ttft_s": [t.ttft_s for t in rounds], "layout": args.layout,
           "world": args.world, "threads": args.threads, "dtype": args.dtype,
           # a TP pair on one host: its all-reduces bypass the wire (shared memory)
           "same_host_memory": trace is not None and bool(trace.inner.same_host),
           # single: its linear layers per kernel (`tandem.kernels.prepare`; GGUF blocks: quant)
           "kernel_layers": dict(kernels.layers) if kernels is not None else None}  # fmt: skip
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
