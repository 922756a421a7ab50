"""`tandem stage`: one TP rank of one pipeline stage, started by the pipeline launcher (internal:
a person never runs it by hand).

Run from the command line, the process ends with `os._exit` once `run` has returned and its cleanup
has run (its links closed) (`tandem.cli.main.LONG_LIVED`): the interpreter's teardown cost over a
second of CPU at every shutdown and released nothing the kernel does not.
"""

from __future__ import annotations

import argparse
import dataclasses

from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S, check_heartbeat_timeout
from tandem.devices import COMPUTE_DTYPES
from tandem.engine.pp.worker import StageOptions, run_stage


def register(sub) -> None:
    p = sub.add_parser(
        "stage",
        help="(internal) one pipeline stage process, started by the launcher",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument(
        "--layers",
        required=True,
        help="this stage's half-open layer range START:END, or auto (probe first, then read it on stdin)",
    )
    p.add_argument(
        "--last", action="store_true", help="this is the last stage: send back to the head"
    )
    p.add_argument("--rank", type=int, required=True, help="global rank in the pipeline grid")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--upstream-rank", type=int, required=True)
    p.add_argument("--downstream-ranks", default="", help="global ranks this leader sends to")
    p.add_argument("--downstream", default="", help="host:port,... of those ranks, or - for stdin")
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-right", default="-", help="host:port of TP rank r+1's ring listener, or -")
    p.add_argument("--tp-listen", default="127.0.0.1:0", help="host:port for the TP ring listener")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port for the upstream link")
    p.add_argument("--cluster-id", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(COMPUTE_DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--wire-dtype", default="float32")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=120.0, help="per-op link timeout, seconds")
    p.add_argument("--idle-timeout", type=float, default=3600.0, help="leave after this long idle")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    p.add_argument(
        "--kernels", default="auto", help="auto (the fast path) or torch (the reference modules)"
    )
    p.add_argument(
        "--beat", default="", help="host:port of the head's heartbeat listener (empty: none)"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds the head (or a stage's ring neighbour) may be silent before it is lost "
        "(0: no heartbeats)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_heartbeat_timeout(args.heartbeat_timeout, "--heartbeat-timeout")
    fields = {f.name for f in dataclasses.fields(StageOptions)}
    return run_stage(StageOptions(**{k: v for k, v in vars(args).items() if k in fields}))
