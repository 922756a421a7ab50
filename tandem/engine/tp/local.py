"""A tensor-parallel group on one machine: N-1 `tandem worker` processes on loopback plus the head
in this process, over the TCP ring, with a fresh random secret and free ports.

Nothing outlives the head: the workers run in a supervised `ProcessGroup` (own session, parent-death
signal) that `TPExecutor.close()` shuts down, a worker leaves its loop as soon as the head's
connection closes, and any failure while the group forms kills the workers before it is raised,
with the tail of the failed worker's log in the message.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tandem.cluster.launcher import ProcessGroup, RankProcess, free_ports
from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S, keepalive_interval
from tandem.comm.base import Communicator
from tandem.comm.metered import MeteredCommunicator
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.layout import cluster_id_for
from tandem.engine.tp.setup import start_head


class LocalGroupError(RuntimeError):
    """A local worker could not start or died while the group formed."""


class LocalWorkers:
    """Ranks 1..N-1 as `tandem worker` processes, started at once (construction returns without
    waiting for them). Start them from a thread that outlives the group: the parent-death signal
    fires when the spawning *thread* exits."""

    def __init__(
        self,
        model_dir: str | Path,
        tp: int,
        *,
        dtypes: list[str],
        devices: list[str],
        op_timeout: float,
        handshake_timeout: float,
        threads: int | None,
        epoch: int = 0,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        kernels: list[str] | None = None,
        ports: list[int] | None = None,
    ) -> None:
        """`ports`: rank r's listening port at index r (default: `tp` ports free a moment ago;
        a caller starting several groups at once passes ports taken together, so that no two
        groups are handed the same port before either binds it)."""
        if tp < 2:
            raise LocalGroupError(f"a local TP group needs at least 2 ranks, got {tp}")
        if ports is not None and len(ports) != tp:
            raise LocalGroupError(f"{tp} ranks need {tp} ports, got {len(ports)}")
        self.tp = tp
        self.epoch = epoch
        self.heartbeat_timeout = heartbeat_timeout
        self.ports = list(ports) if ports is not None else free_ports(tp)
        self.secret = secrets.token_hex(32).encode()
        self.log_dir = Path(tempfile.mkdtemp(prefix="tandem-tp-"))
        peers = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        ranks = []
        for r in range(1, tp):
            argv = [sys.executable, "-m", "tandem", "worker", "--model", str(model_dir)]
            argv += ["--rank", str(r), "--world-size", str(tp), "--peers", peers]
            argv += ["--dtype", dtypes[r], "--device", devices[r]]
            argv += ["--op-timeout", str(op_timeout), "--handshake-timeout", str(handshake_timeout)]
            argv += ["--heartbeat-timeout", str(heartbeat_timeout)]
            if threads:
                argv += ["--threads", str(threads)]
            if epoch:
                argv += ["--epoch", str(epoch)]
            if kernels:
                argv += ["--kernels", kernels[r]]
            ranks.append(RankProcess(f"rank{r}", argv, {"TANDEM_SECRET": self.secret.decode()}))
        self.group = ProcessGroup(ranks, log_dir=self.log_dir, grace_s=2.0)
        self.group.start()

    def exited(self) -> tuple[str, int] | None:
        """(name, exit code) of a worker that has exited, or None while all run."""
        return self.group.poll()

    def pids(self) -> frozenset[int]:
        """The worker processes' pids."""
        return frozenset(p.pid for p in self.group.procs)

    def diagnose(self) -> str | None:
        """Which workers exited and the tail of their logs, or None while all run."""
        return self.group.diagnose()

    def shutdown(self, wait_s: float = 3.0) -> None:
        """Gives workers told to stop `wait_s` to exit on their own, then brings down the rest."""
        self.group.shutdown(wait_s)


def launch_local_tp(
    model_dir: str | Path,
    tp: int,
    *,
    weights: tuple[float, ...] | str | None = None,
    dtypes: list[str] | None = None,
    devices: list[str] | None = None,
    max_batch: int = 8,
    max_seq_len: int = 2048,
    op_timeout: float = 60.0,
    handshake_timeout: float = 120.0,
    threads: int | None = None,
    keepalive_s: float | None = -1.0,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    workers: LocalWorkers | None = None,
    attn_ranks: int | None = None,
    moe: str = "tp",
    epoch: int = 0,
    kernels: str | list[str] = "auto",
    keep: TPExecutor | None = None,
) -> TPExecutor:
    """The head's executor for a local TP group of `tp` ranks; `.close()` stops every worker.
    `kernels` is each rank's `tandem.kernels.prepare` choice ("auto" or "torch"; one for every
    rank, or a list of one per rank: a native rank and a reference rank in one group).
    `workers` may be started beforehand (to start several groups' processes at once). An idle
    group pings its workers every `keepalive_s` (default `keepalive_interval(op_timeout)`; None:
    never) so they outlive pauses between steps longer than the op timeout; every rank's ring
    links carry heartbeats, and a rank silent for `heartbeat_timeout` (0: off) fails the group at
    once (`transport.heartbeat`). `attn_ranks`:
    attention on the first A ranks only, the MLP on all (`TPPlan.attn_ranks`). `moe`: a mixture
    of experts' placement, "tp" (rows of every expert) or "experts" (`TPPlan.moe`). `epoch` > 0: a
    group formed again after a loss (`tandem.engine.recovery`), under its own cluster id; `keep`:
    the broken group's head (same layout), whose loaded shard the new head keeps
    (`tp.rejoin`): only the workers load."""
    if keepalive_s is not None and keepalive_s < 0:
        keepalive_s = keepalive_interval(op_timeout)
    dtypes = dtypes or ["float32"] * tp
    devices = devices or ["cpu"] * tp
    kernels = [kernels] * tp if isinstance(kernels, str) else list(kernels)
    if workers is None:
        workers = LocalWorkers(
            model_dir,
            tp,
            dtypes=dtypes,
            devices=devices,
            op_timeout=op_timeout,
            handshake_timeout=handshake_timeout,
            threads=threads,
            epoch=epoch,
            kernels=kernels,
            heartbeat_timeout=heartbeat_timeout,
        )
    return form_local_group(
        model_dir,
        workers,
        weights=weights,
        dtype=dtypes[0],
        device=devices[0],
        kernels=kernels[0],
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        op_timeout=op_timeout,
        handshake_timeout=handshake_timeout,
        keepalive_s=keepalive_s,
        attn_ranks=attn_ranks,
        moe=moe,
        keep=keep,
    )


def form_local_group(
    model_dir: str | Path,
    workers: LocalWorkers,
    *,
    weights: tuple[float, ...] | None,
    dtype: str,
    device: str,
    max_batch: int,
    max_seq_len: int,
    op_timeout: float,
    handshake_timeout: float,
    keepalive_s: float | None,
    attn_ranks: int | None = None,
    moe: str = "tp",
    kernels: str = "auto",
    keep: TPExecutor | None = None,
) -> TPExecutor:
    """Rank 0 joins the ring with the started `workers`, agrees on the layout and loads its shard
    (or keeps `keep`'s, `tp.rejoin`). Any failure shuts the workers down before it is raised."""
    from tandem.comm.ring import RingCommunicator

    ports, tp = workers.ports, workers.tp
    try:
        comm = _form_ring(
            lambda: RingCommunicator.create(
                0,
                tp,
                right=("127.0.0.1", ports[1]),
                listen=("127.0.0.1", ports[0]),
                secret=workers.secret,
                cluster_id=cluster_id_for(workers.epoch),
                op_timeout=op_timeout,
                handshake_timeout=handshake_timeout,
                heartbeat_timeout=workers.heartbeat_timeout,
            ),
            workers.diagnose,
            handshake_timeout,
        )
        if keep is not None:
            from tandem.engine.tp.rejoin import rejoin_head

            return rejoin_head(
                model_dir,
                keep,
                comm,
                on_close=workers.shutdown,
                keepalive_s=keepalive_s,
                diagnose=workers.diagnose,
                local_workers=workers,
                setup_timeout=handshake_timeout,
            )
        metered = MeteredCommunicator(comm)
        ex = start_head(
            model_dir,
            metered,
            weights=weights,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            dtype=dtype,
            device=device,
            on_close=workers.shutdown,
            keepalive_s=keepalive_s,
            diagnose=workers.diagnose,
            local_workers=workers,
            attn_ranks=attn_ranks,
            moe=moe,
            setup_timeout=handshake_timeout,
            kernels=kernels,
        )
    except BaseException as e:
        why = workers.diagnose()
        workers.shutdown()
        if why is not None and not isinstance(e, KeyboardInterrupt):
            raise LocalGroupError(f"the local TP group failed to form: {e}\n{why}") from e
        raise
    return ex


def _form_ring(create: Any, diagnose: Any, timeout: float) -> Communicator:
    """`create()` on a helper thread, polling the workers so a crashed one fails fast."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["comm"] = create()
        except BaseException as e:
            out["error"] = e

    th = threading.Thread(target=body, name="tp-ring-form", daemon=True)
    th.start()
    deadline = time.monotonic() + timeout + 5.0
    while th.is_alive():
        th.join(0.1)
        why = diagnose()
        if why is not None:
            raise LocalGroupError(f"a worker died before the ring formed: {why}")
        if time.monotonic() > deadline:
            raise LocalGroupError(f"the ring did not form within {timeout:g} s")
    if "error" in out:
        raise out["error"]
    return out["comm"]
