"""The pipeline options of `tandem generate`: `--pp`, `--layout`, `--pp-weights`, `--wire-dtype`,
`--microbatches`, and the executor they describe (stage processes on this machine, over loopback)."""

from __future__ import annotations

import argparse

from tandem.cli.threads import local_threads
from tandem.engine.pp.launch import launch_pipeline
from tandem.engine.pp.layout import parse_layout, plan_stages


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
        help="split the layers in these proportions, e.g. 2,1 (default: by stage speed, counting "
        "the head's LM head)",
    )
    g.add_argument(
        "--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="dtype of the hidden state between stages",
    )  # fmt: skip
    g.add_argument("--microbatches", type=int, default=None, help="default: one per stage")


def wants_pipeline(args: argparse.Namespace) -> bool:
    return bool(args.layout) or args.pp > 1


def describe_stages(stages) -> list[dict]:
    return [
        {"layers": [s.layers.start, s.layers.end], "tp": s.tp, "dtype": s.dtype, "device": s.device}
        for s in stages
    ]


def build_pipeline_executor(
    args: argparse.Namespace, config, *, max_batch: int, max_seq_len: int, dtype: str, device: str
):
    """The `PipelineExecutor` for the options in `args` (its `close()` stops the stage processes)."""
    layout = parse_layout(args.layout, args.pp, getattr(args, "tp", 1) or 1)
    stages = plan_stages(config, layout, pp_weights=args.pp_weights, dtype=dtype, device=device)
    return launch_pipeline(
        args.model,
        stages,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        wire_dtype=args.wire_dtype,
        microbatches=args.microbatches,
        # one OpenMP pool per process, sized so the ranks do not oversubscribe this machine's cores
        threads=args.threads or local_threads(sum(layout)),
    )


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
    }
