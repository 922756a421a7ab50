"""The `--tp` options of `tandem generate` (not a command): parsing, building the group's executor,
and the communication figures added to the JSON.

`--tp N` on one machine launches N-1 local `tandem worker` processes on loopback and keeps the head
(rank 0) in this process. With `RING_CONFIG` set, the ring is the one that file describes (each other
node runs `tandem worker --model DIR` with its own RING_CONFIG) and nothing is launched.
`--dtype` and `--device` take one value for every rank or a comma list, one per rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from tandem.cli.threads import local_threads
from tandem.comm.metered import CommStats, MeteredCommunicator
from tandem.devices import resolve_device, resolve_dtype
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.local import launch_local_tp, per_rank
from tandem.parallel.plan import parse_weights


def add_tp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (head included)")
    p.add_argument("--tp-weights", help="share of the work per rank, e.g. 2,1 (default equal)")
    p.add_argument("--op-timeout", type=float, default=60.0, help="seconds any collective may take")


def resolve_ranks(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(dtype name, device name) per rank from the one-or-list `--dtype` / `--device`."""
    devices = per_rank(args.device, args.tp, "device")
    dtypes = per_rank(args.dtype, args.tp, "dtype")
    out_dev, out_dt = [], []
    for dev, dt in zip(devices, dtypes):
        d = resolve_device(dev)
        out_dev.append(str(d))
        out_dt.append(str(resolve_dtype(dt, d)).removeprefix("torch."))
    return out_dt, out_dev


def tp_executor(args: argparse.Namespace, max_seq_len: int, max_batch: int = 1) -> TPExecutor:
    weights = parse_weights(args.tp_weights, args.tp)
    dtypes, devices = resolve_ranks(args)
    threads = getattr(args, "threads", None)
    if os.environ.get("RING_CONFIG"):
        from tandem.comm import from_env
        from tandem.engine.tp.setup import start_head
        from tandem.loaders.source import open_model

        comm = MeteredCommunicator(
            from_env(model_fingerprint=open_model(Path(args.model)).fingerprint())
        )
        if comm.world_size != args.tp or comm.rank != 0:
            raise SystemExit(
                f"RING_CONFIG describes rank {comm.rank} of {comm.world_size}; the head is rank 0 "
                f"and --tp must equal the world size"
            )
        return start_head(
            args.model,
            comm,
            weights=weights,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            dtype=dtypes[0],
            device=devices[0],
            keepalive_s=args.op_timeout / 4,
        )
    # the head and its workers share this machine's cores (cli.threads: full pools per rank
    # oversubscribe them)
    threads = threads or local_threads(args.tp)
    torch.set_num_threads(threads)
    return launch_local_tp(
        args.model,
        args.tp,
        weights=weights,
        dtypes=dtypes,
        devices=devices,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        op_timeout=args.op_timeout,
        threads=threads,
    )


class TPMeter:
    """Snapshots the group's communication counters at the start and at the first sampled token
    (the end of prefill), so the per-token figures cover decode alone."""

    def __init__(self, ex: TPExecutor) -> None:
        self.ex = ex
        self.at_start = ex.comm_stats.copy()
        self.at_first: CommStats | None = None
        self.tokens = 0

    def token(self) -> None:
        if self.at_first is None:
            self.at_first = self.ex.comm_stats.copy()
        self.tokens += 1

    def report(self) -> dict:
        return comm_report(self.ex, self.at_start, self.at_first, max(0, self.tokens - 1))


def comm_report(
    ex: TPExecutor, at_start: CommStats, at_first: CommStats | None, decode_tokens: int
) -> dict:
    """Per-token communication figures of the decode phase (after the first token), plus prefill."""
    end = ex.comm_stats.copy()
    out: dict = {
        "tp": ex.comm.world_size,
        "tp_weights": list(ex.layout.weights),
        "ranks": [
            {"rank": r.rank, "dtype": r.dtype, "device": r.device, "threads": r.threads}
            for r in ex.ranks
        ],
    }
    if at_first is not None:
        pre = at_first.minus(at_start)
        out["prefill_comm"] = {
            "collectives": pre.collectives,
            "bytes_on_wire": pre.bytes_moved,
            "seconds_in_collectives": round(pre.seconds, 6),
        }
    if at_first is not None and decode_tokens > 0:
        dec = end.minus(at_first)
        out["comm_per_token"] = {
            "collectives": dec.collectives / decode_tokens,
            "bytes_on_wire": dec.bytes_moved / decode_tokens,
            "ms_in_collectives": round(1000 * dec.seconds / decode_tokens, 4),
        }
    return out
