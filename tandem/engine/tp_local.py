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
from tandem.comm.base import Communicator
from tandem.engine.remote import TPExecutor
from tandem.engine.tp_group import start_head
from tandem.parallel.metered import MeteredCommunicator


class LocalGroupError(RuntimeError):
    """A local worker could not start or died while the group formed."""


def per_rank(value: str, n: int, what: str) -> list[str]:
    """`"bfloat16"` -> that value for every rank; `"bfloat16,float16"` -> one per rank."""
    items = [v.strip() for v in value.split(",")]
    if len(items) == 1:
        return items * n
    if len(items) != n or not all(items):
        raise LocalGroupError(f"--{what} {value!r}: give one value or exactly {n} (one per rank)")
    return items


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def launch_local_tp(
    model_dir: str | Path,
    tp: int,
    *,
    weights: tuple[float, ...] | None = None,
    dtypes: list[str] | None = None,
    devices: list[str] | None = None,
    max_batch: int = 8,
    max_seq_len: int = 2048,
    op_timeout: float = 60.0,
    handshake_timeout: float = 120.0,
    threads: int | None = None,
    keepalive_s: float | None = None,
) -> TPExecutor:
    """The head's executor for a local TP group of `tp` ranks; `.close()` stops every worker."""
    from tandem.comm.ring import RingCommunicator

    dtypes = dtypes or ["float32"] * tp
    devices = devices or ["cpu"] * tp
    if tp < 2:
        raise LocalGroupError(f"a local TP group needs at least 2 ranks, got {tp}")
    ports = free_ports(tp)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    secret = secrets.token_bytes(32)
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-tp-"))
    ranks = []
    for r in range(1, tp):
        argv = [sys.executable, "-m", "tandem", "worker", "--model", str(model_dir)]
        argv += ["--rank", str(r), "--world-size", str(tp), "--peers", peers]
        argv += ["--dtype", dtypes[r], "--device", devices[r], "--op-timeout", str(op_timeout)]
        argv += ["--handshake-timeout", str(handshake_timeout)]
        if threads:
            argv += ["--threads", str(threads)]
        ranks.append(RankProcess(f"rank{r}", argv, {"TANDEM_SECRET": secret.hex()}))
    group = ProcessGroup(ranks, log_dir=log_dir, grace_s=2.0)
    group.start()

    def diagnose() -> str | None:
        gone = group.poll()
        if gone is None:
            return None
        name, code = gone
        return f"worker {name} exited with code {code}; its log ends:\n{_tail(log_dir / f'{name}.log')}"

    try:
        comm = _form_ring(
            lambda: RingCommunicator.create(
                0,
                tp,
                right=("127.0.0.1", ports[1]),
                listen=("127.0.0.1", ports[0]),
                secret=secret,
                cluster_id="tandem-tp",
                op_timeout=op_timeout,
                handshake_timeout=handshake_timeout,
            ),
            diagnose,
            handshake_timeout,
        )
        metered = MeteredCommunicator(comm)
        ex = start_head(
            model_dir,
            metered,
            weights=weights,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            dtype=dtypes[0],
            device=devices[0],
            on_close=group.shutdown,
            keepalive_s=keepalive_s,
            diagnose=diagnose,
        )
    except BaseException as e:
        why = diagnose()
        group.shutdown()
        if why is not None and not isinstance(e, KeyboardInterrupt):
            raise LocalGroupError(f"the local TP group failed to form: {e}\n{why}") from e
        raise
    ex.comm_stats = metered.stats
    ex.log_dir = log_dir
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
