"""Spawn a real N-process world on loopback, one communicator per process, and run a scenario.

`run_world(backend, world, scenario, args)` starts `world` processes, forms a ring / star / gloo group on 127.0.0.1 with run-time ports (each rank binds port 0 and
reports it; nothing fixed), calls `scenario(comm, *args)` on every rank, and returns every rank's
result (or raises RankFailed with each failing rank's error). Every process is killed in `finally`.

The ranks come from multiprocessing's "forkserver": one server process per test session imports
torch, the communicators and the scenarios once, and forks each rank from that state, so a world
starts in well under a second instead of paying torch's import in every rank (measured: a 3-rank
world 0.7 s against 9-21 s spawned, on the loaded 2-core machine). Each rank is still its own
process (own sockets, own torch threads, killable and stoppable alone); it gets the parent's sys.path
(multiprocessing's preparation data) and the parent's environment at start (passed along, as a
spawned child would have inherited it), never the server's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

SECRET = b"test-cluster-secret"
# What the forkserver imports once, before it forks a rank: torch, the backends and the scenarios.
PRELOAD = ["torch", "tandem.comm.ring", "tandem.comm.star", "comm_harness", "comm_scenarios"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class RankFailed(RuntimeError):
    def __init__(self, errors: dict[int, tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in sorted(errors.items())))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_comm(backend: str, rank: int, world: int, ports_q: Any, peer_q: Any, options: dict) -> Any:
    from tandem.transport.endpoints import Listener
    from tandem.transport.handshake import Identity

    opts = dict(options)
    delay = opts.pop("delays", {}).get(rank, 0.0)
    if "shared_memory_by_rank" in opts:  # a per-rank opt-in for the ring's same-host pair
        opts["shared_memory"] = opts.pop("shared_memory_by_rank")[rank]
    secret = opts.pop("secret", SECRET)
    if backend == "ring":
        from tandem.comm.ring import RingCommunicator

        lis = Listener("127.0.0.1", 0, Identity("t", rank, world), secret)
        ports_q.put((rank, lis.port))
        right = peer_q.get(timeout=60)
        time.sleep(delay)
        return RingCommunicator.create(
            rank, world, right=("127.0.0.1", right), listener=lis, secret=secret, **opts
        )
    if backend == "star":
        from tandem.comm.star import StarCommunicator

        lis = Listener("127.0.0.1", 0, Identity("t", 0, world), secret) if rank == 0 else None
        if lis is not None:
            ports_q.put((0, lis.port))
        root = peer_q.get(timeout=60)
        time.sleep(delay)
        return StarCommunicator.create(
            rank, world, root=("127.0.0.1", root), listener=lis, secret=secret, **opts
        )
    if backend == "env":
        import os

        from tandem.comm import from_env

        os.environ.update(opts["env"][rank])
        return from_env()
    from tandem.comm.torchdist import TorchDistCommunicator

    port = peer_q.get(timeout=60)
    return TorchDistCommunicator.create(
        rank, world, master=("127.0.0.1", port), backend=backend, **opts
    )


def _child(backend: str, rank: int, world: int, ports_q: Any, peer_q: Any, out_q: Any,
           scenario: Callable, args: tuple, options: dict, environ: dict) -> None:  # fmt: skip
    os.environ.clear()
    os.environ.update(environ)  # the parent's, as at a spawn; not the forkserver's
    import torch

    torch.set_num_threads(1)
    comm = None
    try:
        comm = make_comm(backend, rank, world, ports_q, peer_q, options)
        out_q.put((rank, "ok", scenario(comm, *args)))
    except BaseException as e:
        out_q.put((rank, "err", (type(e).__name__, f"{e}\n{traceback.format_exc()[-1500:]}")))
    finally:
        if comm is not None:
            try:
                comm.close()
            except Exception:
                pass


def run_world(
    backend: str,
    world: int,
    scenario: Callable,
    args: tuple = (),
    *,
    options: dict | None = None,
    timeout: float = 180.0,
    allow_errors: bool = False,
    wait_for: Collection[int] | None = None,
) -> list[Any]:
    """Every rank's scenario result, in rank order. With allow_errors, failed ranks' entries are
    ("error", type name, message) instead of raising. With `wait_for`, only those ranks' results
    are awaited (a victim kept stopped past the survivors' bound need not be waited out): the
    others' entries are None unless they answered first, and their processes are killed."""
    needed = set(range(world) if wait_for is None else wait_for)
    ctx = _context()
    ports_q, out_q = ctx.Queue(), ctx.Queue()
    peer_qs = [ctx.Queue() for _ in range(world)]
    procs = [
        ctx.Process(
            target=_child,
            args=(
                backend,
                r,
                world,
                ports_q,
                peer_qs[r],
                out_q,
                scenario,
                args,
                options or {},
                dict(os.environ),
            ),
            daemon=True,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        if backend == "ring":
            ports = dict(ports_q.get(timeout=120) for _ in range(world))
            for r in range(world):
                peer_qs[r].put(ports[(r + 1) % world])
        elif backend == "star":
            _, root = ports_q.get(timeout=120)
            for q in peer_qs:
                q.put(root)
        elif backend != "env":
            port = _free_port()
            for q in peer_qs:
                q.put(port)
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        gone: dict[int, float] = {}  # rank -> when its process was first seen dead
        while not needed <= results.keys() | errors.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"world did not finish within {timeout:g} s; got {sorted(results)}"
                )
            try:
                rank, status, value = out_q.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r in results or r in errors or p.exitcode is None:
                        continue
                    first = gone.setdefault(r, time.monotonic())
                    if time.monotonic() - first > 2.0:  # its last words had time to arrive
                        errors[r] = ("ProcessExited", f"exit code {p.exitcode}")
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors and not allow_errors:
            raise RankFailed(errors)
        return [
            results[r] if r in results else ("error", *errors[r]) if r in errors else None
            for r in range(world)
        ]
    finally:
        for r, p in enumerate(procs):
            if r not in needed and p.is_alive():
                p.kill()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
