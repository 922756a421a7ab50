"""`tandem generate`'s layout flags (`--tp`, `--tp-weights`, `--pp`, `--layout`, `--pp-weights`,
`--wire-dtype`, `--microbatches`, `--dtype`, `--device`, `--threads`, `--op-timeout`) parsed into
one `Layout`; `tandem.engine.build.build_executor` does the rest. Importing this module needs no
torch; resolving a layout (devices, dtypes) imports it.

With `RING_CONFIG` set and `--tp N`, this process is rank 0 of the ring that file describes (each
other node runs `tandem worker --model DIR` with its own RING_CONFIG) and nothing is launched.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.cli.threads import local_threads
from tandem.devices import dtype_names, resolve_device, resolve_dtype
from tandem.engine.build import Layout, per_rank
from tandem.engine.pp.layout import parse_layout
from tandem.parallel.plan import parse_weights

if TYPE_CHECKING:
    import torch


def resolve_ranks(args: argparse.Namespace, n: int) -> tuple[list[torch.dtype], list[str]]:
    """(dtype, device name) per rank from the one-or-list `--dtype` / `--device` ("auto" resolved
    on each rank's device)."""
    devices = per_rank(args.device, n, "device")
    dtypes = per_rank(args.dtype, n, "dtype")
    out_dev, out_dt = [], []
    for dev, dt in zip(devices, dtypes):
        d = resolve_device(dev)
        out_dev.append(str(d))
        out_dt.append(resolve_dtype(dt, d))
    return out_dt, out_dev


def generate_layout(args: argparse.Namespace, gguf: bool) -> Layout:
    """The layout `tandem generate`'s flags describe. `--dtype auto` resolves on each rank's
    device, except that a GGUF file's weights are dequantized exactly and float32 keeps them so; a
    pipeline takes one dtype and device for every rank or one per rank in rank order (stage 0's
    ranks, then stage 1's, ...): each rank of a TP stage computes in its own dtype, the stage's
    ring and links carrying float32, and a TP stage runs on its first rank's device. The GGUF rule
    holds for every layout (one rank, a TP group, a pipeline), so `--tp 2` computes in the dtype
    `--tp 1` does."""
    stage_tp = parse_layout(args.layout, args.pp, args.tp or 1)
    world = sum(stage_tp)
    if world > 1:  # one dtype and one device per rank
        dtypes, devices = resolve_ranks(args, world)
    else:
        dev = resolve_device(args.device)
        dtypes, devices = [resolve_dtype(args.dtype, dev)], [str(dev)]
    if gguf and args.dtype == "auto":
        dtypes = [dtype_names()["float32"]] * len(dtypes)
    if len(stage_tp) == 1 and world > 1:  # a TP group
        ring = os.environ.get("RING_CONFIG")
        return Layout(
            stage_tp=stage_tp,
            dtypes=tuple(dtypes),
            devices=tuple(devices),
            tp_weights=(  # None: auto where the ranks differ, else equal (tp.probe.choose_weights)
                args.tp_weights
                if args.tp_weights in (None, "auto")
                else parse_weights(args.tp_weights, world)
            ),
            attn_ranks=args.attn_ranks,
            moe=args.moe,
            ring_config=Path(ring) if ring else None,
            # the head and its workers share this machine's cores (cli.threads: full pools per
            # rank oversubscribe them)
            threads=args.threads or (None if ring else local_threads(world)),
            op_timeout=args.op_timeout,
        )
    # a pipeline (one dtype and device for all, or one per rank: each rank its own dtype, a stage
    # on its first rank's device, e.g. a bfloat16 and a float16 TP rank) or one rank
    return Layout(
        stage_tp=stage_tp,
        dtypes=tuple(dtypes),
        devices=tuple(devices),
        pp_weights=args.pp_weights if world > 1 else None,
        wire_dtype=args.wire_dtype,
        microbatches=args.microbatches,
        # one OpenMP pool per process, sized so the ranks do not oversubscribe this machine's cores
        threads=args.threads or (local_threads(world) if world > 1 else None),
    )
