"""The pipeline options of `tandem generate`: `--pp`, `--layout`, `--pp-weights`, `--wire-dtype`,
`--microbatches` (`tandem.cli.layout_args` turns them into a `Layout`: stage processes on this
machine, over loopback), and the pipeline figures added to the JSON."""

from __future__ import annotations

import argparse


def add_pp_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline parallelism (stage processes on this machine)")
    g.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (each a TP group of --tp ranks)"
    )
    g.add_argument(
        "--layout",
        default=None,
        help="TP degree of each stage, e.g. 2,1 = stage 0 at TP=2, stage 1 at TP=1 (implies --pp)",
    )
    g.add_argument(
        "--pp-weights",
        default=None,
        help="split the layers in these proportions, e.g. 2,1, or auto: by each stage's speed and "
        "memory as its processes measure them before loading (default: by stage TP degree, "
        "counting the head's LM head)",
    )
    g.add_argument(
        "--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="dtype of the hidden state between stages",
    )  # fmt: skip
    g.add_argument("--microbatches", type=int, default=None, help="default: one per stage")


def describe_stages(stages) -> list[dict]:
    return [
        {
            "layers": [s.layers.start, s.layers.end],
            "tp": s.tp,
            "dtype": s.dtype,  # TP rank 0's; "rank_dtypes": each TP rank's
            "rank_dtypes": [s.dtype_of(r) for r in range(s.tp)],
            "device": s.device,
        }
        for s in stages
    ]


def pipeline_report(executor, tokens: int) -> dict:
    """The per-token communication figures of a finished run (head's view of the links)."""
    wire = executor.bytes_sent + executor.bytes_received
    hops = executor.stage_hops
    return {
        "stages": describe_stages(executor.stages),
        "wire_dtype": executor.wire_dtype,
        "wire_bytes": wire,
        "wire_bytes_per_token": round(wire / max(1, tokens), 1),
        "socket_bytes_per_token": round(executor.socket_bytes / max(1, tokens), 1),
        "stage_sends": hops,
        "stage_probes": getattr(executor, "stage_probes", None),
    }
