"""Composition: model (directory or GGUF) + layout -> executor -> scheduler -> `ServingEngine`
(for serve, launch and bench). Not a command itself."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from tandem.cli.threads import local_threads
from tandem.config import ModelConfig
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.loaders.safetensors_dir import ModelDir
from tandem.loaders.source import ModelSource, open_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayoutUnavailable(RuntimeError):
    """A --tp / --pp layout this build cannot run (yet), or that does not fit the model."""


def _progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class _ProgressDir(ModelDir):
    """A model directory that reports the bytes of every tensor read (for the loading bar)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.total_bytes = sum(info.nbytes for info in self.manifest.values())
        self.on_read: Callable[[int], None] = lambda n: None

    def read(self, name: str, *args, **kwargs) -> torch.Tensor:
        t = super().read(name, *args, **kwargs)
        self.on_read(t.numel() * t.element_size())
        return t


def build_executor(
    model_dir: Path,
    config: ModelConfig,
    *,
    tp: int,
    pp: int,
    dtype: str,
    device: str,
    max_batch: int,
    max_seq_len: int,
    console: Console,
    ring_config: Path | None = None,
    source: ModelSource | None = None,
    reform_timeout: float = 0.0,
    op_timeout: float | None = None,
):
    """The executor for the layout; its `close()` brings down whatever it started. With
    `ring_config`, this process is rank 0 of a TP group whose workers run on other machines.
    `source`: the model already opened at `model_dir` (a single-node GGUF model is loaded from
    it rather than parsed again). `reform_timeout` > 0: a local group that loses a rank is formed
    again (new processes, a new epoch) within that many seconds and the scheduler replays
    (`tandem.engine.recovery`); 0: the first loss ends it. `op_timeout`: a local group's bound
    on one collective or pipeline hop (None: each launcher's default)."""
    if ring_config is not None:
        return _remote_tp_head(
            model_dir, ring_config, dtype, device, max_batch, max_seq_len, console
        )
    if tp < 1 or pp < 1:
        raise LayoutUnavailable(f"--tp and --pp must be at least 1, got tp={tp} pp={pp}")
    if tp * pp == 1:
        from tandem.engine.local import LocalExecutor
        from tandem.loaders.load import load_model

        if dtype not in DTYPES:
            raise LayoutUnavailable(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        if isinstance(source, ModelDir) or source is None:
            with _progress(console) as bar:
                md = _ProgressDir(model_dir)
                task = bar.add_task("loading weights", total=md.total_bytes)
                md.on_read = lambda n: bar.advance(task, n)
                model = load_model(md, dtype=DTYPES[dtype], device=device)
        else:  # GGUF: the weights stay mapped in their blocks; there is little to wait for
            md = source
            model = load_model(md, dtype=DTYPES[dtype], device=device)
        return LocalExecutor(
            model, max_batch=max_batch, max_seq_len=max_seq_len, weight_format=md.weight_format()
        )
    from tandem.engine.tp.local import per_rank

    dtypes = per_rank(dtype, tp * pp, "dtype")
    devices = per_rank(device, tp * pp, "device")
    # The ranks share this machine's cores: oversubscribed OpenMP pools spin against each other
    # and every collective waits for a descheduled peer.
    threads = local_threads(tp * pp)
    torch.set_num_threads(threads)
    with console.status(f"starting {tp * pp} ranks, loading their shards, forming the group..."):
        from tandem.engine.recovery import with_recovery

        if pp == 1:
            from tandem.engine.tp.local import launch_local_tp

            def build_tp(epoch: int):
                return launch_local_tp(
                    model_dir,
                    tp,
                    dtypes=dtypes,
                    devices=devices,
                    max_batch=max_batch,
                    max_seq_len=max_seq_len,
                    threads=threads,  # an idle group pings every keepalive_interval(op_timeout)
                    epoch=epoch,
                    **({} if op_timeout is None else {"op_timeout": op_timeout}),
                )

            return with_recovery(build_tp, reform_timeout)
        from tandem.engine.pp.launch import launch_pipeline
        from tandem.engine.pp.layout import plan_stages

        # layer ranges by stage speed (its TP degree), the head's LM head counted against stage 0
        stages = plan_stages(config, [tp] * pp, dtype=",".join(dtypes), device=",".join(devices))

        def build_pp(epoch: int):  # each pipeline has its own random cluster id: a new epoch
            return launch_pipeline(
                model_dir,
                stages,
                max_batch=max_batch,
                max_seq_len=max_seq_len,
                threads=threads,
                **({} if op_timeout is None else {"timeout": op_timeout}),
            )

        return with_recovery(build_pp, reform_timeout)


def _remote_tp_head(model_dir, ring_config, dtype, device, max_batch, max_seq_len, console):
    import os

    from tandem.cluster.ring_config import keepalive_interval, load_ring_config
    from tandem.comm import from_env
    from tandem.comm.metered import MeteredCommunicator
    from tandem.engine.tp.setup import start_head

    # pings inside the workers' op timeout (the ring's own, from the same file), however short
    keepalive_s = keepalive_interval(load_ring_config(ring_config).op_timeout)

    with console.status(f"waiting for the ring of {ring_config} to form (workers joining)..."):
        comm = from_env({**os.environ, "RING_CONFIG": str(ring_config)})
    if comm.rank != 0:
        comm.close()
        raise LayoutUnavailable(f"{ring_config} is rank {comm.rank}: only rank 0 serves")
    metered = MeteredCommunicator(comm)
    with console.status(
        f"agreeing on the model with {comm.world_size - 1} worker(s), loading shards"
    ):
        ex = start_head(
            model_dir,
            metered,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            dtype=dtype,
            device=device,
            keepalive_s=keepalive_s,
        )
    ex.comm_stats = metered.stats
    ex.join_rtt_ms = join_rtts(os.environ.get("TANDEM_JOIN_RTT_MS", ""), comm.world_size)
    return ex


def join_rtts(text: str, world_size: int) -> dict[int, float]:
    """`{"1": 0.42, ...}` (what `cluster join` hands the head: each rank's round trip to the head
    when it joined, in ms) -> {rank: ms}; entries that are not a rank and a finite number are
    dropped (a figure shown must be one that was measured)."""
    try:
        raw = json.loads(text) if text else {}
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    out = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isdigit() and 0 < int(k) < world_size):
            continue
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            out[int(k)] = float(v)
    return out


def executor_health(executor) -> Callable[[], tuple[bool, str]]:
    """Whole while the executor has not recorded a failure (a dead or hung rank)."""

    def health() -> tuple[bool, str]:
        own = getattr(executor, "health", None)
        if callable(own):
            return own()
        failure = getattr(executor, "_failure", None) or getattr(executor, "_failed", None)
        if failure:
            return False, str(failure)
        return True, "ok"

    return health


def executor_stats(executor) -> Callable[[], dict[str, float]]:
    """Collective time and bytes on the wire, from whichever counters the executor keeps."""

    def stats() -> dict[str, float]:
        out: dict[str, float] = {}
        comm = getattr(executor, "comm_stats", None)
        if comm is not None:
            out["collectives"] = comm.collectives
            out["collective_seconds"] = comm.seconds
            out["wire_bytes"] = comm.bytes_moved
        sent = getattr(executor, "bytes_sent", None)
        if isinstance(sent, int):
            received = getattr(executor, "bytes_received", 0)
            out["wire_bytes"] = out.get("wire_bytes", 0) + sent + received
        recovery = getattr(executor, "recovery_stats", None)
        if callable(recovery):
            out.update(recovery())
        return out

    return stats


def build_serving_engine(
    model_dir: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
    max_batch: int = 8,
    max_seq_len: int | None = None,
    name: str | None = None,
    console: Console | None = None,
    ring_config: Path | None = None,
    reform_timeout: float = 0.0,
    op_timeout: float | None = None,
) -> tuple[ServingEngine, Callable[[], None]]:
    """A started engine and the function that stops it (scheduler first, then the executor)."""
    console = console or Console(stderr=True)
    source = open_model(model_dir)
    config = source.config
    seq_len = min(max_seq_len or 2048, config.max_position_embeddings)
    tokenizer = source.tokenizer()
    if tokenizer is None:
        raise LayoutUnavailable(f"{model_dir}: no tokenizer; the server needs a tokenizer")
    executor = build_executor(
        model_dir,
        config,
        tp=tp,
        pp=pp,
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        max_seq_len=seq_len,
        console=console,
        ring_config=ring_config,
        source=source,
        reform_timeout=reform_timeout,
        op_timeout=op_timeout,
    )
    eos = tuple(config.eos_token_ids) + tuple(tokenizer.eos_token_ids)
    scheduler = Scheduler(executor, eos_token_ids=eos)
    chat = tokenizer.apply_chat_template if tokenizer.has_chat_template else None
    engine = ServingEngine(
        scheduler,
        tokenizer,
        name or model_dir.resolve().name.removesuffix(".gguf"),
        chat_template=chat,
        health=executor_health(executor),
        executor_stats=executor_stats(executor),
    )
    scheduler.start()

    def close() -> None:
        scheduler.stop()
        executor.close()

    return engine, close
