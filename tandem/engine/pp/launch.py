"""Launches a pipeline (optionally of tensor-parallel stages) on this machine over loopback.

The head (this process) is global rank 0: TP rank 0 of stage 0. Every other (stage, TP rank) is a
`tandem stage` process (`tandem.engine.pp.worker`). Start-up, in order:

  1. the head binds its return-link listener; each worker binds its upstream listener and reports
     its ephemeral port on stdout (all workers start at once and load their layers in parallel);
  2. each stage leader is told, on stdin, the addresses of every rank of the next stage (the last
     stage: the head's), and dials them; every worker accepts its upstream link;
  3. the head loads the embedding, its layers and the LM head, dials stage 0's other TP ranks and
     stage 1's ranks, and accepts the link back from the last stage;
  4. with a heartbeat timeout, every worker dials the head's heartbeat listener (its address is in
     the worker's argv) and the head starts watching them (`tandem.engine.pp.beats`).

Every link is authenticated with a fresh random secret (passed in the environment). Each worker's
stderr goes to a log file whose tail is quoted when the pipeline fails.
"""

from __future__ import annotations

import os
import secrets
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.cluster.launcher import ProcessGroup, RankProcess
from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S, check_heartbeat_timeout
from tandem.devices import DTYPE_NAMES
from tandem.engine import device_probe
from tandem.engine.cluster_info import pipeline_facts
from tandem.engine.pp.beats import accept_beats, beat_listener
from tandem.engine.pp.head import PipelineExecutor
from tandem.engine.pp.layout import StageProbe, StageSpec, auto_ranges
from tandem.engine.pp.links import (
    LinkTerms,
    StageListener,
    dial_all,
    grid_ranks,
    max_frame_bytes,
)
from tandem.engine.pp.stage import StageRunner
from tandem.engine.pp.tp_stage import form_stage_ring, load_tp_stage, ring_listener
from tandem.engine.pp.worker import READY
from tandem.kernels import mapped_guard
from tandem.kernels.prepare import prepare
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.parallel.partition import validate_ranges


class LaunchError(RuntimeError):
    """A stage process did not start, or exited before the pipeline was up."""


def _read_ports(
    group: ProcessGroup, name: str, proc: subprocess.Popen, timeout: float
) -> tuple[int, int, tuple[float, float] | None]:
    """(stage port, ring port, (GEMV GB/s, free GB) when the stage probed) from its READY line."""
    deadline = time.monotonic() + timeout
    out = proc.stdout
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([out], [], [], 0.2)
        if ready:
            chunk = os.read(out.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith(READY):
                    parts = line.split()
                    probed = (float(parts[3]), float(parts[4])) if len(parts) == 5 else None
                    return int(parts[1]), int(parts[2]), probed
        elif proc.poll() is not None:
            break
    log = group.log_path(name)
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log else []
    raise LaunchError(f"{name} did not start listening within {timeout:g} s: {' | '.join(tail)}")


def launch_pipeline(
    model_dir: str | Path,
    stages: Sequence[StageSpec],
    *,
    max_batch: int = 8,
    max_seq_len: int = 2048,
    wire_dtype: str = "float32",
    timeout: float = 120.0,
    microbatches: int | None = None,
    threads: int = 0,
    addresses: Sequence[str] | None = None,
    argv_prefix: Callable[[int], list[str]] | None = None,
    kernels: str = "auto",
    auto_layers: bool = False,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> PipelineExecutor:
    """Starts the stage processes and returns the head's `PipelineExecutor` (close it to stop them).

    `addresses[g]` is the address global rank g binds and is reached at (default 127.0.0.1 for
    all); `argv_prefix(g)` prefixes rank g's command (e.g. `ip netns exec NS`, for the emulated
    hosts of `tandem bench`); `kernels` is every stage's (and TP rank's) `tandem.kernels.prepare` choice
    ("torch": the reference modules, as a single node built with `kernels="torch"`).
    `auto_layers`: the ranges in `stages` are replaced by `auto_ranges` over the probes every rank
    runs before it loads (the workers in their own processes, the head here); the executor's
    `stage_probes` holds them. `heartbeat_timeout`: a rank silent this long is lost (every stage
    process beats to the head, and a TP stage's ring carries its own; 0: no heartbeats)."""
    check_heartbeat_timeout(heartbeat_timeout, "heartbeat_timeout")
    md = open_model(model_dir)
    cfg = md.config
    validate_ranges([s.layers for s in stages], cfg.num_hidden_layers)
    layout = [s.tp for s in stages]
    ranks = grid_ranks(layout)
    world = sum(layout)
    cluster_id = f"pp-{secrets.token_hex(4)}"
    secret = secrets.token_hex(32)
    terms = LinkTerms(
        cluster_id,
        world,
        wire_dtype,
        md.fingerprint(),
        secret.encode(),
        handshake_timeout=max(timeout, 60.0),
        op_timeout=timeout,
        max_frame_bytes=max_frame_bytes(max_batch, max_seq_len, cfg.hidden_size),
    )

    def addr(g: int) -> str:
        return addresses[g] if addresses is not None else "127.0.0.1"

    head_listener = StageListener(terms, 0, addr(0))
    beats = beat_listener(terms, addr(0)) if heartbeat_timeout > 0 else None
    group = ProcessGroup(log_dir=Path(tempfile.mkdtemp(prefix="tandem-pp-")), grace_s=2.0)
    env = {"TANDEM_SECRET": secret}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        procs: dict[int, subprocess.Popen] = {}
        names: dict[int, str] = {}
        for k, spec in enumerate(stages):
            for r, g in enumerate(ranks[k]):
                if g == 0:
                    continue
                last = k == len(stages) - 1
                if r == 0:
                    down = ranks[k + 1] if not last else [0]
                else:
                    down = []
                upstream = ranks[k - 1][0] if k > 0 else 0
                argv = [
                    sys.executable, "-m", "tandem", "stage",
                    "--model", str(model_dir), "--stage", str(k),
                    "--layers", "auto" if auto_layers else f"{spec.layers.start}:{spec.layers.end}",
                    "--rank", str(g), "--world-size", str(world),
                    "--upstream-rank", str(upstream),
                    "--downstream-ranks", ",".join(map(str, down)), "--downstream", "-",
                    "--tp-rank", str(r), "--tp-size", str(spec.tp),
                    "--cluster-id", cluster_id, "--dtype", spec.dtype_of(r), "--device", spec.device,
                    "--wire-dtype", wire_dtype, "--max-batch", str(max_batch),
                    "--max-seq-len", str(max_seq_len), "--timeout", str(timeout),
                    "--threads", str(threads), "--kernels", kernels,
                ]  # fmt: skip
                argv += ["--listen", f"{addr(g)}:0", "--tp-listen", f"{addr(g)}:0"]
                argv += ["--heartbeat-timeout", str(heartbeat_timeout)]
                if beats is not None:
                    argv += ["--beat", f"{addr(0)}:{beats.port}"]
                if last:
                    argv.append("--last")
                if argv_prefix is not None:
                    argv = [*argv_prefix(g), *argv]
                names[g] = f"stage {k} rank {r}"
                procs[g] = group.spawn(RankProcess(names[g], argv, env, pipes=True))
        got = {g: _read_ports(group, names[g], p, max(timeout, 60.0)) for g, p in procs.items()}
        probes = None
        if auto_layers:  # the workers wait on stdin for their range: the head measures alone
            got[0] = (0, 0, device_probe.measure_local(stages[0].device, stages[0].dtype))
            probes = [
                StageProbe(*zip(*(got[g][2] for g in ranks[k]), strict=True))
                for k in range(len(stages))
            ]
            stages = auto_ranges(cfg, stages, probes)
        head_ring = ring_listener(addr(0), 0) if stages[0].tp > 1 else None
        got[0] = (head_listener.port, head_ring.port if head_ring else 0, None)
        ports = {g: p[0] for g, p in got.items()}
        for k in range(len(stages)):
            for r, g in enumerate(ranks[k]):
                if g == 0:
                    continue
                down = ""
                if r == 0:
                    nxt = ranks[k + 1] if k + 1 < len(stages) else [0]
                    down = ",".join(f"{addr(d)}:{ports[d]}" for d in nxt)
                right = ranks[k][(r + 1) % len(ranks[k])]
                ring = f"{addr(right)}:{got[right][1]}" if stages[k].tp > 1 else ""
                span = stages[k].layers
                first = f"{span.start}:{span.end}\n" if auto_layers else ""
                procs[g].stdin.write(f"{first}{down}\n{ring}\n".encode())
                procs[g].stdin.flush()
        head_right = f"{addr(ranks[0][1])}:{got[ranks[0][1]][1]}" if head_ring else ""
        pids = {0: os.getpid(), **{g: p.pid for g, p in procs.items()}}
        hosts = {g: addr(g) for g in pids} if addresses is not None else {}
        facts = pipeline_facts(cfg, md.weight_format(), stages, ranks, pids, hosts, md)
        executor = _build_head(
            md, stages, ranks, ports, terms, head_listener, group, head_ring, head_right, addr,
            max_batch=max_batch, max_seq_len=max_seq_len, wire_dtype=wire_dtype,
            timeout=timeout, microbatches=microbatches, kernels=kernels, facts=facts,
            heartbeat_timeout=heartbeat_timeout,
        )  # fmt: skip
        executor.stage_probes = [p.as_dict() for p in probes] if probes else None
        if beats is not None:
            try:
                executor.watch(accept_beats(beats, terms, sorted(procs)), heartbeat_timeout)
            except BaseException:
                executor.close()
                raise
        return executor
    except BaseException:
        head_listener.close()
        group.shutdown()
        raise
    finally:
        if beats is not None:
            beats.close()


def _build_head(
    md,
    stages,
    ranks,
    ports,
    terms,
    head_listener,
    group,
    head_ring,
    head_right,
    addr,
    *,
    max_batch,
    max_seq_len,
    wire_dtype,
    timeout,
    microbatches,
    kernels,
    facts,
    heartbeat_timeout,
) -> PipelineExecutor:
    s0 = stages[0]
    dtype = DTYPE_NAMES[s0.dtype]
    r0 = (s0.layers.start, s0.layers.end)
    box: dict = {}
    n = len(stages)

    def accept() -> None:
        try:
            box["from_last"] = head_listener.accept(ranks[n - 1][0], f"head <- stage {n - 1}")
        except Exception as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    acceptor = threading.Thread(target=accept, daemon=True)
    if n > 1:
        acceptor.start()
    comm = None
    # at TP > 1 stage 0's layers are sharded (below); the head keeps only embedding and LM head
    head_layers = r0 if s0.tp == 1 else (r0[0], r0[0])
    embed_head = load_model(md, dtype=dtype, device=s0.device, layer_range=head_layers)
    mapped_guard.watch(md)  # the head's GGUF blocks stay mapped: a SIGBUS on them is named
    prepare(embed_head, kernel=kernels)  # the single-node fast path (tandem.kernels)
    if s0.tp == 1:
        stage0 = StageRunner(embed_head, max_batch, max_seq_len)
    else:
        comm = form_stage_ring(
            0, s0.tp, head_ring, head_right, secret=terms.secret,
            cluster_id=f"{terms.cluster_id}/stage0", fingerprint=md.fingerprint(), timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
        )  # fmt: skip
        shard = load_tp_stage(md, r0, comm, dtype=dtype, device=s0.device, kernels=kernels)
        stage0 = StageRunner(shard, max_batch, max_seq_len)
    peers = dial_all(
        terms, 0, [f"{addr(g)}:{ports[g]}" for g in ranks[0][1:]], ranks[0][1:], "head"
    )
    to_next = (
        dial_all(terms, 0, [f"{addr(g)}:{ports[g]}" for g in ranks[1]], ranks[1], "head")
        if n > 1
        else []
    )
    if n > 1:
        acceptor.join()
    head_listener.close()
    if "err" in box:
        raise box["err"]

    def on_close() -> None:
        group.shutdown(wait_s=5.0)  # the stages leave on STOP; stragglers are brought down
        if comm is not None:
            comm.close()

    return PipelineExecutor(
        embed_head,
        stage0,
        to_next=to_next,
        from_last=box.get("from_last"),
        to_stage0_peers=peers,
        num_stages=n,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        wire_dtype=wire_dtype,
        timeout=timeout,
        microbatches=microbatches,
        diagnose=lambda: group.diagnose(wait_s=1.0, lines=3),
        on_close=on_close,
        stages=stages,
        grid=[list(r) for r in ranks],
        facts=facts,
        worker_pids=group.rank_pids(),
        worker_procs=list(group.procs),
    )
