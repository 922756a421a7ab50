"""Per-host lockstep probe: what k TP ranks sharing this machine lose, per sync, to waiting.

A TP rank's decode step is a chain of (compute segment, small all-reduce) pairs: it streams its
share of half a layer's weights, then all-reduces one hidden state (4 D bytes), 2 L + 3 times per
token. `plan_model` predicts one such pair on k co-located ranks as

    t_model(k) = max(t_seg, k t_seg / slots) + a(k)          (its `group_time` and `allreduce_s`)

with t_seg one segment alone. What it leaves out is lockstep waiting: a rank woken by its peer's
data may wait for a core (more ranks than cores: a scheduler slice at every sync), the segments do
not start together, and the slowest rank sets every sync's pace. The probe measures it directly:
k real processes on this host, joined by tandem's ring over loopback, each looping

    y = W_i @ x   (W_i: D x (layer_params / 2 / k / D) f32, cycling through a pool > L3, 1 thread)
    all_reduce(y)

and the penalty per sync is  p(k) = t_iter(k) - t_model(k)  (`penalty_s`, >= 0), with the slots
and link terms the plan itself uses (the caller's). A separate process times the same segments
alone (t_seg); the k ranks also run the segments without the all-reduce (`free_s`: what k
concurrent segments cost, i.e. this host's slots for them). Every figure is the median over
blocks of `block` iterations (a block is one token's syncs), as a decode step's figure is.

    python -m tandem.bench.lockstep --world K --rank R --peers A:P,... --cols C   (one rank)
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

POOL_MB = 128  # per rank: > this machine's 32 MB L3, so every segment streams from memory
DEFAULT_BLOCKS = 10


class LockstepProbeError(RuntimeError):
    """A probe rank failed or the probe was asked for something it cannot run."""


def segment_cols(config: Any, k: int) -> int:
    """Columns of one rank's segment matrix (D rows): its 1/k share of half a decoder layer."""
    from tandem.parallel.partition import model_cost

    d = config.hidden_size
    return max(1, math.ceil(model_cost(config).layer_params / 2 / k / d))


def syncs_per_token(config: Any) -> int:
    """Collectives per decode token on a TP head stage: 2 per layer, the embedding all-reduce,
    the control broadcast and the greedy argmax's all-reduce."""
    return 2 * config.num_hidden_layers + 3


def penalty_s(t_iter: float, t_seg: float, k: int, slots: float, sync_s: float) -> float:
    """p(k): measured seconds per (segment, all-reduce) minus the plan's prediction for it (k
    equal segments on one host of `slots`, then the all-reduce's `sync_s`)."""
    from tandem.bench.plan_model import NodeSpec, group_time

    host = [NodeSpec(f"r{i}", 1.0, host="here", slots=slots) for i in range(k)]
    return max(0.0, t_iter - group_time([t_seg] * k, host) - sync_s)


# ---- one rank ---------------------------------------------------------------------------------


def _pool(d: int, cols: int, pool_mb: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    n = max(2, math.ceil(pool_mb * 2**20 / (4 * d * cols)))
    g = torch.Generator().manual_seed(0)
    return [torch.rand(d, cols, generator=g) for _ in range(n)], torch.rand(cols, generator=g)


def _segment(mats: list[torch.Tensor], x: torch.Tensor):
    """Iteration i's compute: the next pool matrix times x, (D, cols) @ (cols,) -> (D,)."""
    return lambda i: torch.mv(mats[i % len(mats)], x)


def _blocks(step, n_blocks: int, block: int) -> float:
    """Median over blocks of seconds per iteration (after one warm-up block)."""
    i, per = 0, []
    for b in range(n_blocks + 1):
        t0 = time.perf_counter()
        for _ in range(block):
            step(i)
            i += 1
        if b:
            per.append((time.perf_counter() - t0) / block)
    return statistics.median(per)


def run_rank(args: argparse.Namespace) -> dict:
    """World 1: every `--cols` segment alone. World k: free-running segments, then lockstep."""
    torch.set_num_threads(1)
    cols_list = [int(c) for c in args.cols.split(",")]
    if args.world == 1:
        alone = {}
        for cols in cols_list:
            mats, x = _pool(args.hidden, cols, args.pool_mb)
            alone[str(cols)] = _blocks(_segment(mats, x), args.blocks, args.block)
            del mats
        return {"world": 1, "alone_s": alone}
    from tandem.bench.ring_access import connect_ring

    comm = connect_ring(args.rank, args.world, args.peers.split(","), args.secret)
    try:
        mats, x = _pool(args.hidden, cols_list[0], args.pool_mb)
        comm.barrier()
        seg = _segment(mats, x)
        free = _blocks(seg, args.blocks, args.block)
        comm.barrier()
        lock = _blocks(lambda i: comm.all_reduce_sum(seg(i)),
                       args.blocks, args.block)  # fmt: skip
        row = torch.zeros(args.world)
        row[args.rank] = free
        frees = comm.all_reduce_sum(row)  # every rank's free-running figure (x + 0 = x)
    finally:
        comm.close()
    return {"world": args.world, "free_s": float(frees.mean()), "lockstep_s": lock}


# ---- the probe --------------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run_ranks(argvs: list[list[str]], timeout_s: float) -> dict:
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argvs]  # fmt: skip
    try:
        out, err = procs[0].communicate(timeout=timeout_s)
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if procs[0].returncode != 0 or any(p.returncode != 0 for p in procs):
        raise LockstepProbeError(f"lockstep probe rank failed: {err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])


def measure_lockstep(
    config: Any,
    ks: tuple[int, ...] = (2, 3),
    blocks: int = DEFAULT_BLOCKS,
    pool_mb: int = POOL_MB,
    timeout_s: float = 300.0,
) -> dict:
    """Raw figures per k (`alone_s`, `free_s`, `lockstep_s`: seconds per iteration); turn them
    into penalties with `penalties` and the plan's slots and link."""
    ks = tuple(sorted({k for k in ks if k >= 2}))
    if not ks:
        raise LockstepProbeError("the lockstep probe needs some k >= 2")
    d, block = config.hidden_size, syncs_per_token(config)
    cols = {k: segment_cols(config, k) for k in ks}
    base = [sys.executable, "-m", "tandem.bench.lockstep", "--hidden", str(d), "--block",
            str(block), "--blocks", str(blocks), "--pool-mb", str(pool_mb)]  # fmt: skip
    alone = _run_ranks([[*base, "--world", "1", "--cols", ",".join(str(cols[k]) for k in ks)]],
                       timeout_s)["alone_s"]  # fmt: skip
    out: dict = {"hidden": d, "block": block, "pool_mb": pool_mb, "by_k": {}}
    for k in ks:
        peers = ",".join(f"127.0.0.1:{p}" for p in _free_ports(k))
        argv = [*base, "--world", str(k), "--peers", peers, "--secret", secrets.token_hex(16),
                "--cols", str(cols[k])]  # fmt: skip
        r = _run_ranks([[*argv, "--rank", str(r)] for r in range(k)], timeout_s)
        t_seg = alone[str(cols[k])]
        out["by_k"][str(k)] = {"cols": cols[k], "alone_s": t_seg, "free_s": r["free_s"],
                               "lockstep_s": r["lockstep_s"],
                               "slots": min(float(k), max(1.0, k * t_seg / r["free_s"]))}  # fmt: skip
    return out


def penalties(probe: dict, slots: float, sync_s) -> dict[int, float]:
    """k -> p(k) from `measure_lockstep`'s figures; `sync_s(k)` is the plan's all-reduce time
    of one hidden state over k ranks on this host's link."""
    return {int(k): penalty_s(f["lockstep_s"], f["alone_s"], int(k), slots, sync_s(int(k)))
            for k, f in probe["by_k"].items()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.lockstep")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--peers", default="", help="every rank's ADDR:PORT, in rank order")
    p.add_argument("--secret", default="")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--cols", required=True, help="segment columns (world 1: a comma list)")
    p.add_argument("--block", type=int, default=59, help="iterations per timed block")
    p.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    p.add_argument("--pool-mb", type=int, default=POOL_MB)
    out = run_rank(p.parse_args(argv))
    if p.parse_args(argv).rank == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
