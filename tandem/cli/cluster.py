"""`tandem cluster init | join | status`: form a cluster from one pasted (or scanned) token.

    tandem cluster init --hosts 192.168.77.1,192.168.77.2 [--layout tp|pp|tp2xpp2] [--write-configs DIR]
    tandem cluster join TOKEN [--device D --dtype T] [--rank R] [--model DIR]
    tandem cluster status TOKEN [--model DIR] [--json]

The token carries the hosts, ports, layout and a fresh secret. `join` finds its rank from this
machine's addresses (or `--rank`), writes its RING_CONFIG file (mode 0600: it holds the secret),
announces itself to the head's status board (rank 0 runs the board) and starts its worker. With
`--rejoin` a worker rank outlives its head: it waits for the next head on the same token, announces
itself to its board and starts a fresh worker process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from tandem.cli.cluster_epochs import (
    head_epoch,
    health_url,
    next_epoch,
    publish_epochs,
    superseded,
)
from tandem.cli.cluster_probe import PROBE_COLUMNS, probe_cells, publish_probes, view_url
from tandem.cli.serve import DEFAULT_REFORM_TIMEOUT_S, add_reasoning_argument
from tandem.cluster.launcher import LaunchError, ProcessGroup, RankProcess
from tandem.cluster.ring_config import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    RingConfigError,
    check_heartbeat_timeout,
    check_timeout,
)
from tandem.cluster.status import (
    RankOccupied,
    StatusAuthError,
    StatusBoard,
    StatusError,
    announce,
    keep_alive,
    measure_rtt_ms,
    new_instance,
    query,
)
from tandem.cluster.token import (
    ClusterTopology,
    JoinTokenError,
    decode_token,
    encode_token,
    new_topology,
    parse_layout,
    token_qr,
)
from tandem.config import ModelConfig
from tandem.loaders.safetensors_dir import ModelFileError
from tandem.loaders.source import open_model
from tandem.parallel.partition import split_by_weights
from tandem.parallel.plan import plan_for_config


class ClusterCliError(RuntimeError):
    """A cluster command the user must correct (ambiguous rank, unknown host...)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="form a cluster: init, join, status",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cluster_command", required=True)

    init = sub.add_parser("init", help="make a join token (and RING_CONFIG files) for these hosts")
    init.add_argument("--hosts", required=True, help="comma-separated hosts, rank order")
    init.add_argument("--layout", default="tp", help="tp (default), pp, or e.g. tp2xpp2")
    init.add_argument("--base-port", type=int, default=29500, help="rank r listens on base+r")
    init.add_argument("--model", default=None, help="pin a model name in the token")
    init.add_argument(
        "--write-configs", default=None, metavar="DIR", help="write ring<r>.json here"
    )
    init.add_argument("--no-qr", action="store_true", help="do not draw the QR code")
    init.set_defaults(func=run_init)

    join = sub.add_parser("join", help="join the cluster a token describes")
    join.add_argument("token")
    join.add_argument(
        "--rank", type=int, default=None, help="this node's rank (default: by address)"
    )
    join.add_argument("--device", default="cpu")
    join.add_argument("--dtype", default="float32")
    join.add_argument("--model", default=None, help="model directory (starts the worker / head)")
    join.add_argument("--config-dir", default=None, help="where to write RING_CONFIG")
    join.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the head")
    join.add_argument("--host", default="127.0.0.1", help="rank 0: the HTTP server's bind address")
    join.add_argument("--port", type=int, default=8000, help="rank 0: the HTTP server's port")
    join.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="rank 0: names a request's Host may carry besides IP addresses, localhost and the "
        "bound name, as `tandem serve --allowed-hosts` takes them",
    )
    join.add_argument(
        "--rejoin",
        action="store_true",
        help="a worker rank: when its worker process or the head goes, free the model and join "
        "the head again (the same head's next epoch, or the next head)",
    )
    join.add_argument(
        "--reform-timeout",
        type=float,
        default=DEFAULT_REFORM_TIMEOUT_S,
        help="rank 0: seconds a group that lost a worker has to re-form (the worker rejoins, "
        f"requests in flight are replayed) before requests fail (default "
        f"{DEFAULT_REFORM_TIMEOUT_S:g}, as under serve and launch); 0: a lost worker ends it",
    )
    add_reasoning_argument(join)  # rank 0: its server's, as `tandem serve` takes it
    join.add_argument(
        "--op-timeout",
        type=float,
        default=None,
        help="seconds one collective may wait on a peer before it counts as hung (default 60)",
    )
    join.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds a ring neighbour may send no heartbeat before it counts as lost (hung, "
        "stopped, cut off) and the group re-forms without waiting for the op timeout (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT_S:g}, as under serve and launch; 0: off)",
    )
    join.add_argument(
        "--shrink-after",
        type=float,
        default=0.0,
        help="rank 0 of a two-rank group: seconds a lost worker has to come back before the "
        "head serves alone (if the whole model fits it); 0: wait for the worker",
    )
    join.set_defaults(func=run_join)

    status = sub.add_parser("status", help="who has joined, and what each rank holds")
    status.add_argument("token")
    status.add_argument("--model", default=None, help="model directory, to show layer ranges")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=run_status)


def _fail(cmd: str, e: BaseException) -> int:
    print(f"tandem cluster {cmd}: error: {e}", file=sys.stderr)
    return 2


# ---- init ---------------------------------------------------------------------------------------


def run_init(args: argparse.Namespace) -> int:
    try:
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        tp, pp = parse_layout(args.layout, len(hosts))
        topo = new_topology(hosts, tp, pp, base_port=args.base_port, model=args.model)
        token = encode_token(topo)
        if args.write_configs:
            for r in range(topo.world_size):
                _write_ring_config(Path(args.write_configs), topo, r)
    except (ValueError, OSError) as e:
        return _fail("init", e)
    if not args.no_qr:
        print(token_qr(token))
    print(f"cluster {topo.cluster_id}: {topo.world_size} ranks, tp={tp} x pp={pp}")
    print(f"on each node:  tandem cluster join {token}")
    print(token)
    return 0


def _write_ring_config(
    directory: Path,
    topo: ClusterTopology,
    rank: int,
    op_timeout: float | None = None,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> Path:
    """This rank's RING_CONFIG (0600: it holds the secret); `op_timeout`: this rank's bound on a
    collective (the file's default otherwise); `heartbeat_timeout`: how long a silent neighbour
    has before it counts as lost (0: no heartbeats)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ring{rank}.json"
    cfg = topo.ring_config(rank)
    if op_timeout is not None:
        cfg["op_timeout"] = check_timeout("--op-timeout", op_timeout, "cluster join")
    cfg["heartbeat_timeout"] = check_heartbeat_timeout(
        heartbeat_timeout, "cluster join: --heartbeat-timeout"
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


# ---- join ---------------------------------------------------------------------------------------


def local_addresses() -> set[str]:
    addrs = {"localhost", socket.gethostname(), socket.getfqdn()}
    for entries in psutil.net_if_addrs().values():
        addrs.update(
            e.address.split("%")[0]
            for e in entries
            if e.family in (socket.AF_INET, socket.AF_INET6)
        )
    return addrs


def assign_rank(topo: ClusterTopology, rank: int | None, mine: set[str] | None = None) -> int:
    """`--rank` if given; else the one rank whose host is this machine (ambiguity is an error)."""
    if rank is not None:
        if not 0 <= rank < topo.world_size:
            raise ClusterCliError(f"--rank {rank}: this cluster has ranks 0..{topo.world_size - 1}")
        return rank
    mine = local_addresses() if mine is None else mine
    matches = [r for r, h in enumerate(topo.hosts) if h in mine]
    if not matches:
        raise ClusterCliError(
            f"none of this cluster's hosts ({', '.join(topo.hosts)}) is an address of this machine; "
            "pass --rank"
        )
    if len(matches) > 1:
        raise ClusterCliError(f"this machine is ranks {matches} of the token; pass --rank")
    return matches[0]


def role_of(topo: ClusterTopology, rank: int, config: ModelConfig | None = None) -> str:
    """What `rank` holds: its pipeline stage and layer range, and its tensor-parallel shard (kv heads
    and MLP rows from the TP plan) when the model's config is known. Half-open ranges."""
    stage, shard = divmod(rank, topo.tp)
    parts = []
    if config is not None:
        ranges = split_by_weights(config.num_hidden_layers, [1.0] * topo.pp)
        prefix = f"stage {stage}/{topo.pp} " if topo.pp > 1 else ""
        parts.append(f"{prefix}layers {ranges[stage]}")
    elif topo.pp > 1:
        parts.append(f"stage {stage}/{topo.pp}")
    if topo.tp > 1:
        text = f"tp shard {shard}/{topo.tp}"
        if config is not None:
            plan = plan_for_config(config, topo.tp)
            kv, mlp = plan.kv_heads[shard], plan.intermediate[shard]
            text += f" kv heads [{kv.start}, {kv.end}) mlp rows [{mlp.start}, {mlp.end})"
        parts.append(text)
    return " | ".join(parts) or "whole model"


def run_join(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        topo = decode_token(args.token)
        if args.model and topo.pp > 1:
            raise ClusterCliError(
                f"this token's layout is tp={topo.tp} x pp={topo.pp}; joined clusters run tensor "
                "parallelism only in this build (use --layout tp, or `tandem serve --pp` on one host)"
            )
        rank = assign_rank(topo, args.rank)
        config_dir = Path(args.config_dir or Path.home() / ".cache" / "tandem" / topo.cluster_id)
        ring_file = _write_ring_config(
            config_dir, topo, rank, args.op_timeout, args.heartbeat_timeout
        )
    except (JoinTokenError, ClusterCliError, ModelFileError, RingConfigError, OSError) as e:
        return _fail("join", e)
    facts = {
        "host": topo.hosts[rank],
        "device": args.device,
        "dtype": args.dtype,
        "pid": os.getpid(),
    }
    facts["role"] = role_of(topo, rank, _model_config(args.model))
    console.print(f"rank {rank} of {topo.world_size} ({facts['role']}); RING_CONFIG={ring_file}")
    board = None
    stop_beat = threading.Event()
    epoch = 0
    try:
        if rank == 0:
            board = StatusBoard(
                topo.secret,
                host=_bind_host(topo.hosts[0]),
                port=topo.status_port,
                world_size=topo.world_size,
            ).start()
            board.update(0, **facts, rtt_ms=0.0, joined_at=time.time(), head=new_instance())
            _wait_for_ranks(console, topo, board, args.timeout)
        elif getattr(args, "rejoin", False) and args.model:
            return _serve_heads(console, args, topo, rank, ring_file, facts)
        else:
            rtt = _reach_head(console, topo, args.timeout)
            instance = _announce(topo, rank, {**facts, "rtt_ms": round(rtt, 3)}, args.timeout)
            keep_alive(topo.hosts[0], topo.status_port, topo.secret, rank, instance, stop_beat)
            epoch = head_epoch(topo)[1] if args.model else 0
        rtts = _join_rtts(board) if board is not None else {}
        if board is not None and args.model:  # the head's probes and epoch onto the board
            publish_probes(board, view_url(args.host, args.port), stop_beat)
            publish_epochs(board, health_url(args.host, args.port), stop_beat)
        return _run_rank(console, args, rank, ring_file, rtts, epoch)
    except KeyboardInterrupt:
        return 130
    except (StatusError, LaunchError, ClusterCliError, OSError) as e:
        return _fail("join", e)
    finally:
        stop_beat.set()
        if board is not None:
            board.close()


def _serve_heads(
    console: Console,
    args: argparse.Namespace,
    topo: ClusterTopology,
    rank: int,
    ring_file: Path,
    facts: dict,
) -> int:
    """`join --rejoin` on a worker rank: join the head, run the worker until it exits (the worker
    process died, or the head went or re-formed: the worker process and its model memory go with
    it), then join again: the same head's next epoch, or the next head on the same token
    (`cluster_epochs.next_epoch`); a worker that fails at start backs off
    (`worker_rejoin.next_delay`) instead of crash-looping. One holder id for the rank throughout,
    so its row on the board is this node's again at once. Ends on Ctrl-C only."""
    from tandem.cli.worker_rejoin import next_delay

    delay, served, instance = 0.0, None, new_instance()
    while True:
        rtt = _reach_head(console, topo, math.inf)
        _announce(topo, rank, {**facts, "rtt_ms": round(rtt, 3)}, args.timeout, instance)
        stop_beat = threading.Event()
        keep_alive(topo.hosts[0], topo.status_port, topo.secret, rank, instance, stop_beat)
        t0 = time.monotonic()
        try:
            served = next_epoch(topo, served)
            stale = superseded(topo, served)  # the head re-formed without it: a hung worker
            code = _run_rank(console, args, rank, ring_file, epoch=served[1], until=stale)
        finally:
            stop_beat.set()
        up = time.monotonic() - t0
        delay = next_delay(up, delay) if code is not None else 0.0
        why = f"exited with code {code}" if code is not None else "was given up by its head"
        console.print(
            f"the worker of epoch {served[1]} {why} after {up:.1f} s; "
            f"joining the head again" + (f" in {delay:g} s" if delay else "")
        )
        time.sleep(delay)


def _bind_host(host: str) -> str:
    return host if host in local_addresses() else "0.0.0.0"


def _model_config(model: str | None) -> ModelConfig | None:
    return open_model(model).config if model else None


def _reach_head(console: Console, topo: ClusterTopology, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    with console.status(f"waiting for the head at {topo.hosts[0]}:{topo.status_port}"):
        while True:
            try:
                return measure_rtt_ms(topo.hosts[0], topo.status_port, topo.secret)
            except StatusError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _announce(
    topo: ClusterTopology, rank: int, facts: dict, timeout_s: float, instance: str | None = None
) -> str:
    """Claims `rank` on the head's board, retrying while the board is busy (past its cap it closes
    connections unread); another live holder (RankOccupied) or another secret is final."""
    deadline = time.monotonic() + timeout_s
    instance = instance or new_instance()  # one id for every try: a lost reply's claim is ours
    while True:
        try:
            return announce(
                topo.hosts[0], topo.status_port, topo.secret, rank, instance=instance, **facts
            )
        except (RankOccupied, StatusAuthError):
            raise
        except StatusError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _wait_for_ranks(
    console: Console, topo: ClusterTopology, board: StatusBoard, timeout_s: float
) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + timeout_s
    with Progress(
        TextColumn("ranks joined"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("join", total=topo.world_size)
        while True:
            n = len(board.snapshot()["ranks"])
            bar.update(task, completed=n)
            if n >= topo.world_size:
                return
            if time.monotonic() > deadline:
                missing = sorted(
                    set(range(topo.world_size)) - {r["rank"] for r in board.snapshot()["ranks"]}
                )
                raise ClusterCliError(f"ranks {missing} did not join within {timeout_s:.0f} s")
            time.sleep(0.2)


def _join_rtts(board: StatusBoard) -> dict[int, float]:
    """Each rank's round trip to the head, as it measured it when it joined (ms)."""
    out = {}
    for r in board.snapshot()["ranks"]:
        rtt = r.get("rtt_ms")
        if r["rank"] != 0 and isinstance(rtt, int | float) and not isinstance(rtt, bool):
            out[r["rank"]] = float(rtt)
    return out


def rank_argv(args: argparse.Namespace, rank: int, ring_file: Path, epoch: int = 0) -> list[str]:
    """The command a joined rank runs: the head `tandem serve` over the ring with its server's
    flags (`--reform-timeout`, `--reasoning-parser`, `--shrink-after`, `--allowed-hosts`), a
    worker `tandem worker` claiming `epoch`."""
    if rank == 0:
        argv = [sys.executable, "-m", "tandem", "serve", "--model", args.model]
        argv += ["--ring-config", str(ring_file), "--host", args.host, "--port", str(args.port)]
        argv += ["--reform-timeout", str(getattr(args, "reform_timeout", 0.0))]
        argv += ["--reasoning-parser", getattr(args, "reasoning_parser", "auto")]
        if getattr(args, "shrink_after", 0.0):
            argv += ["--shrink-after", str(args.shrink_after)]
        if getattr(args, "allowed_hosts", None):
            argv += ["--allowed-hosts", args.allowed_hosts]
    else:
        argv = [sys.executable, "-m", "tandem", "worker", "--model", args.model]
        argv += ["--epoch", str(epoch)]
    return argv + ["--device", args.device, "--dtype", args.dtype]


def _run_rank(
    console: Console,
    args: argparse.Namespace,
    rank: int,
    ring_file: Path,
    rtts: dict[int, float] | None = None,
    epoch: int = 0,
    until: Callable[[], bool] | None = None,
) -> int | None:
    """With --model, run this rank's process (the head serves, the others work) until it ends.
    The head's server gets the ranks' join-time RTTs (`TANDEM_JOIN_RTT_MS`) for its cluster view
    and re-forms a group that lost a worker (`--reform-timeout`); a worker claims `epoch`.
    `until()` turning true ends the process early (then None)."""
    if not args.model:
        console.print("joined; no --model given, so holding the slot (Ctrl-C to leave)")
        while True:
            time.sleep(3600)
    argv = rank_argv(args, rank, ring_file, epoch)
    env = {"RING_CONFIG": str(ring_file)}
    if rank == 0 and rtts:
        env["TANDEM_JOIN_RTT_MS"] = json.dumps(rtts)
    group = ProcessGroup([RankProcess(f"rank{rank}", argv, env)])
    with group:
        gone = group.wait(until)
        if gone is None:  # given up by its head (hung): nothing to finish, end it at once
            group.grace_s = 0.0
    return None if gone is None else gone[1]


# ---- status -------------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    try:
        topo = decode_token(args.token)
        snap = query(topo.hosts[0], topo.status_port, topo.secret)
    except (JoinTokenError, StatusError) as e:
        return _fail("status", e)
    if args.json:
        print(json.dumps(snap, indent=2))
        return 0
    config = _model_config(args.model)
    joined = {r["rank"]: r for r in snap["ranks"]}
    table = Table(
        title=f"cluster {topo.cluster_id}: {len(joined)}/{topo.world_size} joined, tp={topo.tp} x pp={topo.pp}"
    )
    cols = ("rank", "host", "state", "device", "dtype", "layers / shard", "rtt to head", "pid")
    for col in cols + PROBE_COLUMNS:
        table.add_column(col)
    for r in range(topo.world_size):
        info = joined.get(r)
        if info is None:
            table.add_row(
                str(r),
                topo.hosts[r],
                "[red]missing[/red]",
                "",
                "",
                role_of(topo, r, config),
                "",
                "",
                *probe_cells({}),
            )
            continue
        rtt = info.get("rtt_ms")
        table.add_row(
            str(r),
            str(info.get("host", topo.hosts[r])),
            "[green]joined[/green]" if info.get("alive", True) else "[yellow]gone[/yellow]",
            str(info.get("device", "?")),
            str(info.get("dtype", "?")),
            str(info.get("role") or role_of(topo, r, config)),
            "-" if rtt is None else f"{rtt:.2f} ms",
            str(info.get("pid", "")),
            *probe_cells(info),
        )
    Console(width=200).print(table)
    return 0 if len(joined) == topo.world_size else 1
