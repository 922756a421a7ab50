"""One rank of an all-reduce microbenchmark: our host-staged ring, torch's gloo, or the floor (a
bare socket swap + add), same sizes.

    python -m tandem.bench.collective_run --backend gloo --rank R --world N --master ADDR:PORT
    python -m tandem.bench.collective_run --backend ring --rank R --world N --peers A:P,B:P,...

Every rank runs `warmup + iters` all-reduces of each size (f32 tensors, as the TP layers send);
rank 0 prints one JSON object: per size, the median / p90 seconds per all-reduce. For the ring it
also splits the median into host staging (device -> host f32 and back), reduction (the f32 adds)
and wire (the rest: framing, syscalls, the link, waiting for the peer), the first two timed on
the same tensor by themselves. With --cold-mb, small sizes are also timed "cold" (`cold_sync_s`):
each op after streaming that much memory, as a decode step's all-reduces follow weight reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch


class CollectiveBenchError(RuntimeError):
    """The benchmark cannot run as asked (unknown backend, bad peers)."""


def _gloo(rank: int, world: int, master: str) -> tuple[Callable, Callable]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}", rank=rank, world_size=world,
        timeout=__import__("datetime").timedelta(seconds=60),
    )  # fmt: skip

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    return all_reduce, dist.destroy_process_group


def _ring(rank: int, world: int, peers: list[str], secret: str) -> tuple[Callable, Callable]:
    from tandem.comm.peers import connect_ring

    comm = connect_ring(rank, world, peers, secret)
    return comm.all_reduce_sum, comm.close


def _socket(rank: int, world: int, peers: list[str]) -> tuple[Callable, Callable]:
    """The floor: two ranks swap raw f32 bytes over one TCP connection and add (no framing, no
    auth, no checks). World 2 only."""
    import socket

    from tandem.comm.peers import parse_peers

    if world != 2:
        raise CollectiveBenchError("the bare socket exchange is for world 2 only")
    host, port = parse_peers(peers)[0]
    if rank == 0:
        with socket.create_server((host, port)) as srv:
            srv.settimeout(60)
            conn, _ = srv.accept()
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = socket.create_connection((host, port), timeout=60)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    conn.settimeout(60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        mine = t.numpy()
        # both ranks send at once: a large send would fill both socket buffers and deadlock
        sender = threading.Thread(target=conn.sendall, args=(memoryview(mine).cast("B"),))
        sender.start()
        got = bytearray(mine.nbytes)
        view, n = memoryview(got), 0
        while n < len(got):
            k = conn.recv_into(view[n:])
            if k == 0:
                raise CollectiveBenchError("peer closed")
            n += k
        sender.join()
        other = np.frombuffer(got, dtype=np.float32)
        a, b = (mine, other) if rank == 0 else (other, mine)
        return torch.from_numpy(a + b)

    return all_reduce, conn.close


def _median_p90(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def _time_each(fn: Callable[[], object], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def staging_and_reduction_s(nbytes: int, world: int, iters: int = 200) -> tuple[float, float]:
    """Median seconds to stage one f32 tensor of `nbytes` to the host wire and back, and to add
    the world-1 received copies in f32 (what every rank does per all-reduce besides the wire)."""
    from tandem.comm.staging import stage_to_host, unstage

    t = torch.randn(nbytes // 4)
    host = stage_to_host(t, torch.float32)
    staging = _time_each(lambda: unstage(stage_to_host(t, torch.float32).copy(), t.shape, t), iters)
    acc, other = host.copy(), host.copy()

    def reduce() -> None:
        for _ in range(world - 1):
            np.add(acc, other, out=acc)

    return statistics.median(staging), statistics.median(_time_each(reduce, iters))


def cold_sync_s(
    all_reduce: Callable, rank: int, world: int, nbytes: int, iters: int, stream_mb: int
) -> list[float]:
    """Per op, the all-reduce as a decode step meets it: every rank first streams `stream_mb` MB
    through its caches (as it streams weights between two all-reduces), then runs the op; the op's
    own cost is the fastest rank's time (that rank arrived last, so it did not wait for a peer).
    The ranks' times meet in one more all-reduce (each writes its row of a zero matrix)."""
    junk = np.ones(stream_mb * (1 << 20) // 4, dtype=np.float32)
    t = torch.full((nbytes // 4,), float(rank + 1))
    mine = []
    for _ in range(iters):
        float(junk.sum())  # evicts the op's code and data from L1/L2/L3, as the weights do
        x = t.clone()
        t0 = time.perf_counter()
        all_reduce(x)
        mine.append(time.perf_counter() - t0)
    table = torch.zeros(world, iters)
    table[rank] = torch.tensor(mine)
    every = all_reduce(table)  # (world, iters): x + 0 = x, so exactly every rank's times
    return [float(v) for v in every.min(0).values]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    if args.backend == "gloo":
        all_reduce, close = _gloo(args.rank, args.world, args.master)
    elif args.backend == "ring":
        all_reduce, close = _ring(args.rank, args.world, args.peers.split(","), args.secret)
    elif args.backend == "socket":
        all_reduce, close = _socket(args.rank, args.world, args.peers.split(","))
    else:
        raise CollectiveBenchError(f"unknown backend {args.backend!r}")
    results = []
    try:
        for nbytes in (int(b) for b in args.bytes.split(",")):
            t = torch.full((nbytes // 4,), float(args.rank + 1))
            iters = max(10, min(args.iters, int(args.byte_budget // nbytes)))
            for _ in range(min(args.warmup, iters)):
                all_reduce(t.clone())
            times = _time_each(lambda t=t: all_reduce(t.clone()), iters)
            med, p90 = _median_p90(times)
            row = {"bytes": nbytes, "median_s": med, "p90_s": p90, "iters": iters}
            if args.backend == "ring":
                staging, reduction = staging_and_reduction_s(nbytes, args.world)
                row.update(staging_s=staging, reduction_s=reduction,
                           wire_s=max(med - staging - reduction, 0.0))  # fmt: skip
            if args.cold_mb > 0 and nbytes <= 65536:
                cold = cold_sync_s(all_reduce, args.rank, args.world, nbytes,
                                   min(iters, 100), args.cold_mb)  # fmt: skip
                row["cold_median_s"], row["cold_p90_s"] = _median_p90(cold)
            results.append(row)
    finally:
        close()
    return {"backend": args.backend, "world": args.world, "rank": args.rank, "sizes": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.collective_run")
    p.add_argument("--backend", choices=["gloo", "ring", "socket"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", help="gloo rendezvous ADDR:PORT (rank 0's host)")
    p.add_argument("--peers", help="ring: every rank's ADDR:PORT in rank order")
    p.add_argument("--secret", default=os.environ.get("TANDEM_BENCH_SECRET", ""))
    p.add_argument("--bytes", default="4096,65536,1048576")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--byte-budget", type=float, default=64e6, help="fewer iterations for big sizes")
    p.add_argument("--cold-mb", type=int, default=0,
                   help="also time small ops after streaming this many MB (the decode case)")  # fmt: skip
    out = run(p.parse_args(argv))
    if out["rank"] == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
