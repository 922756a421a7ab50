"""`tandem worker --model DIR`: one tensor-parallel worker (any rank but 0) of a group whose head runs
`tandem generate --tp N` or `tandem serve`.

The worker holds only its shard and KV cache; it takes the layout from the head, runs the steps the
head sends, and exits when the head stops or its connection closes; with `--rejoin` it then frees
the model and waits for the next head (`tandem.cli.worker_rejoin`). Its place in the ring comes
from `--rank/--world-size/--peers` (what the local launcher passes) or, across machines, from
`RING_CONFIG` (`tandem.comm.from_env`). The cluster secret is read from `TANDEM_SECRET` (hex), never
from the command line.

Run from the command line, the process ends with `os._exit` once `run` has returned and its cleanup
has run (the ring closed) (`tandem.cli.main.LONG_LIVED`): the interpreter's teardown cost over a
second of CPU at every shutdown and released nothing the kernel does not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S, check_heartbeat_timeout
from tandem.comm.base import Communicator
from tandem.devices import COMPUTE_DTYPES
from tandem.engine.tp.layout import cluster_id_for
from tandem.engine.tp.setup import run_worker

DEFAULT_OP_TIMEOUT_S = 60.0


class WorkerArgsError(ValueError):
    """The worker's ring position is missing or inconsistent."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one tensor-parallel worker rank (not the head)")
    p.add_argument("--model", required=True, help="model directory (same files as the head's)")
    p.add_argument(
        "--dtype", default="float32", choices=list(COMPUTE_DTYPES), help="this rank's compute dtype"
    )
    p.add_argument("--device", default="cpu", help="this rank's device (cpu, cuda:0, mps, ...)")
    p.add_argument("--rank", type=int, help="this rank (1..N-1); default from RING_CONFIG")
    p.add_argument("--world-size", type=int, help="ranks in the group, head included")
    p.add_argument("--peers", help="host:port of every rank, comma-separated, in rank order")
    p.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT_S)
    p.add_argument("--handshake-timeout", type=float, default=120.0)
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="seconds a ring neighbour may send no heartbeat before it counts as lost (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT_S:g}, or RING_CONFIG's heartbeat_timeout; 0: off)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads for this rank")
    p.add_argument(
        "--epoch", type=int, default=0, help="the group's epoch (a group re-formed after a loss)"
    )
    p.add_argument(
        "--kernels", default="auto", help="auto (the fast path) or torch (the reference modules)"
    )
    p.add_argument(
        "--rejoin",
        action="store_true",
        help="when the head goes, free the model and wait for the next head (tandem.cli.worker_rejoin)",
    )
    p.set_defaults(func=run)


def parse_peers(text: str, world_size: int) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise WorkerArgsError(f"--peers item {item!r} is not host:port")
        out.append((host, int(port)))
    if len(out) != world_size:
        raise WorkerArgsError(f"--peers lists {len(out)} ranks, --world-size is {world_size}")
    return out


def ring_from_args(
    rank: int,
    world_size: int,
    peers: list[tuple[str, int]],
    secret: bytes | None,
    *,
    op_timeout: float,
    handshake_timeout: float,
    cluster_id: str = "tandem-tp",
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> Communicator:
    """Rank `rank` of a ring over `peers`: listen on its own address, dial the next rank's."""
    from tandem.comm.ring import RingCommunicator

    if not 0 <= rank < world_size:
        raise WorkerArgsError(f"rank {rank} is not in [0, {world_size})")
    host, port = peers[rank]  # this rank's own address: listen there, not on every interface
    return RingCommunicator.create(
        rank,
        world_size,
        right=peers[(rank + 1) % world_size],
        listen=(host, port),
        secret=secret,
        cluster_id=cluster_id,
        op_timeout=op_timeout,
        handshake_timeout=handshake_timeout,
        heartbeat_timeout=heartbeat_timeout,
    )


def secret_from_env() -> bytes | None:
    """TANDEM_SECRET as bytes (its text encoded, as `tandem.comm.from_env` reads it)."""
    text = os.environ.get("TANDEM_SECRET", "")
    return text.encode() if text else None


def run(args: argparse.Namespace) -> int:
    if args.rejoin:
        if sys.argv[1:2] != ["worker"]:
            raise WorkerArgsError("--rejoin is for the command line (`tandem worker --rejoin`)")
        from tandem.cli.worker_rejoin import exec_supervisor

        exec_supervisor(sys.argv[1:])  # does not return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    heartbeat = (
        None
        if args.heartbeat_timeout is None
        else check_heartbeat_timeout(args.heartbeat_timeout, "--heartbeat-timeout")
    )
    if args.peers is not None:
        if args.rank is None or args.world_size is None:
            raise WorkerArgsError("--peers needs --rank and --world-size")
        peers = parse_peers(args.peers, args.world_size)
        comm = ring_from_args(
            args.rank,
            args.world_size,
            peers,
            secret_from_env(),
            op_timeout=args.op_timeout,
            handshake_timeout=args.handshake_timeout,
            cluster_id=cluster_id_for(args.epoch),
            heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT_S if heartbeat is None else heartbeat,
        )
    elif os.environ.get("RING_CONFIG"):
        from tandem.cluster.ring_config import epoch_cluster_id, load_ring_config
        from tandem.comm import from_env

        env = dict(os.environ)
        if args.epoch:  # the head re-formed the ring after a loss: claim its epoch
            base = env.get("TANDEM_CLUSTER_ID") or load_ring_config(env["RING_CONFIG"]).cluster_id
            env["TANDEM_CLUSTER_ID"] = epoch_cluster_id(base, args.epoch)
        comm = from_env(env, heartbeat_timeout=heartbeat)
    else:
        raise WorkerArgsError("give --rank/--world-size/--peers, or set RING_CONFIG")
    if comm.rank == 0:
        raise WorkerArgsError("rank 0 is the head: run `tandem generate` or `tandem serve` there")
    try:
        steps = run_worker(
            args.model,
            comm,
            dtype=args.dtype,
            device=args.device,
            setup_timeout=args.handshake_timeout if args.peers is not None else None,
            kernels=args.kernels,
        )
    finally:
        comm.close()
    print(f"worker rank {comm.rank}: {steps} steps, head said stop", file=sys.stderr)
    return 0
