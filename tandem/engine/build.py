"""One road from a model and a `Layout` to an `Executor`, for generate, serve, launch and bench.

A `Layout` says how the ranks are arranged; `Limits` how many sequences of what length the caches
hold. `build_executor` picks the executor the layout names:

    world 1                          -> LocalExecutor   (the whole model in this process)
    ring_config, or hooks.comm       -> TPExecutor      (rank 0 of a TP group on other machines)
    one stage of N > 1 ranks         -> TPExecutor      (N-1 local `tandem worker` processes)
    M > 1 stages of t_0..t_M-1 ranks -> PipelineExecutor (local `tandem stage` processes)

Whatever it starts, the executor's `close()` brings down. Importing this module needs no torch;
a `Layout` holds torch dtypes, so making one imports it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S
from tandem.devices import COMPUTE_DTYPES, dtype_name, dtype_names
from tandem.engine.executor import Executor
from tandem.loaders.source import ModelSource, open_model
from tandem.parallel.plan import MOE_PLACEMENTS

if TYPE_CHECKING:
    import torch

    from tandem.comm.base import Communicator
    from tandem.engine.tp.head import TPExecutor


class LayoutUnavailable(RuntimeError):
    """A layout this build cannot run, or that does not fit the model or the ring."""


def per_rank(value: str, n: int, what: str) -> list[str]:
    """`"bfloat16"` -> that value for every rank; `"bfloat16,float16"` -> one per rank."""
    items = [v.strip() for v in value.split(",")]
    if len(items) == 1:
        return items * n
    if len(items) != n or not all(items):
        raise LayoutUnavailable(f"--{what} {value!r}: give one value or exactly {n} (one per rank)")
    return items


@dataclass(frozen=True)
class Layout:
    """How one model is laid out over ranks.

    `stage_tp[k]` is the TP degree of pipeline stage k (so `(1,)` is one device, `(N,)` a TP
    group, `(2, 1)` a pipeline whose stage 0 is a TP pair); the world is `sum(stage_tp)` ranks.
    `dtypes` and `devices` hold one entry for every rank or one per rank, in rank order (stage 0's
    ranks first). `tp_weights`: each TP rank's share of the work (None: equal); `pp_weights`:
    the stages' layer proportions as `--pp-weights` gives them (None: by stage TP degree; "auto":
    by each stage's probed GEMV speed and free memory).
    `wire_dtype`: the hidden state between stages. `ring_config`: this process is rank 0 of the TP
    group that file describes, its workers started elsewhere. `threads`: this process's CPU
    threads (None: torch's default). `op_timeout`: seconds any collective of a local group may
    take; `heartbeat_timeout`: seconds a rank of a local TP group or pipeline may be silent before it counts
    as lost (0: no heartbeats; a RING_CONFIG group takes the file's). `attn_ranks`: attention on the first A ranks of a one-stage TP group, the MLP on all
    (`parallel.plan`; None: every rank). `moe`: where a mixture of experts' experts go in a
    one-stage TP group, "tp" (rows of every expert on every rank) or "experts" (whole experts,
    their count by the ranks' weights); pipeline stages hold whole layers."""

    stage_tp: tuple[int, ...] = (1,)
    dtypes: tuple[torch.dtype, ...] = field(default_factory=lambda: (dtype_names()["float32"],))
    devices: tuple[str, ...] = ("cpu",)
    tp_weights: tuple[float, ...] | str | None = None  # or "auto": from the probe at join
    pp_weights: str | None = None
    wire_dtype: str = "float32"
    microbatches: int | None = None
    ring_config: Path | None = None
    threads: int | None = None
    op_timeout: float = 60.0
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    attn_ranks: int | None = None
    moe: str = "tp"

    def __post_init__(self) -> None:
        if not self.stage_tp or min(self.stage_tp) < 1:
            raise LayoutUnavailable(f"every stage needs at least 1 rank, got {list(self.stage_tp)}")
        for what, values in (("dtype", self.dtypes), ("device", self.devices)):
            if len(values) not in (1, self.world_size):
                raise LayoutUnavailable(
                    f"give one {what} or exactly {self.world_size} (one per rank), "
                    f"got {len(values)}"
                )
        bad = [d for d in self.dtypes if d not in dtype_names().values()]
        if bad:
            raise LayoutUnavailable(f"dtype {bad[0]}: choose one of {', '.join(COMPUTE_DTYPES)}")
        if self.attn_ranks is not None and (self.pp > 1 or not 1 <= self.attn_ranks <= self.tp):
            raise LayoutUnavailable(
                f"--attn-ranks {self.attn_ranks}: a one-stage TP group of {self.tp} ranks takes "
                f"1 to {self.tp}"
            )
        if self.moe not in MOE_PLACEMENTS:
            raise LayoutUnavailable(f"--moe {self.moe}: choose one of {', '.join(MOE_PLACEMENTS)}")

    @property
    def world_size(self) -> int:
        return sum(self.stage_tp)

    @property
    def tp(self) -> int:
        """The TP degree of stage 0 (of the group, when there is one stage)."""
        return self.stage_tp[0]

    @property
    def pp(self) -> int:
        return len(self.stage_tp)

    def dtype_names(self) -> list[str]:
        """One dtype name per rank."""
        names = [dtype_name(d) for d in self.dtypes]
        return names * self.world_size if len(names) == 1 else names

    def device_names(self) -> list[str]:
        """One device name per rank."""
        return (
            list(self.devices) * self.world_size if len(self.devices) == 1 else list(self.devices)
        )


@dataclass(frozen=True)
class Limits:
    """What every rank's KV cache holds: up to `max_batch` sequences of `max_seq_len` tokens (capped
    by the model's own context)."""

    max_batch: int = 8
    max_seq_len: int = 2048


def _quiet(_text: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class BuildHooks:
    """What the caller shows while the executor forms: `status(text)` a context manager around each
    wait; `source` the model already opened (a single device loads from it, e.g. one that reports
    its reads to a progress bar); `epoch` > 0: the group is formed again after losing a rank
    (`tandem.engine.recovery`), and a local TP ring claims that epoch in its cluster id;
    `notice(text)` a line about the layout chosen (the TP weights and why; the probed ranges under
    `--pp-weights auto`);
    `keep`: the broken group's TP head (`tp.rejoin.keepable`), whose loaded shard the head of the
    group formed again for the same layout keeps: only the returning workers load;
    `handshake_timeout`: the bound on forming a ring from the layout's RING_CONFIG (None: the
    file's), so that a re-form attempt ends in time for a shrink.

    What the caller already holds or decides (the bench's rank programs): `comm` a TP group
    already formed with this process as rank 0 (e.g. one whose collectives are traced): the head
    runs over it, the layout's `ring_config` unread; `addresses[g]` the address global rank g of
    a local pipeline binds and is reached at, `argv_prefix(g)` a prefix of its command (e.g.
    `ip netns exec NS`)."""

    status: Callable[[str], AbstractContextManager[None]] = field(default=_quiet)
    source: ModelSource | None = None
    epoch: int = 0
    notice: Callable[[str], None] = field(default=lambda _text: None)
    comm: Communicator | None = None
    addresses: Sequence[str] | None = None
    argv_prefix: Callable[[int], list[str]] | None = None
    keep: Executor | None = None
    handshake_timeout: float | None = None


def build_executor(
    model: str | Path, layout: Layout, limits: Limits, hooks: BuildHooks | None = None
) -> Executor:
    """The executor for `layout` over the model at `model` (a directory or a GGUF file)."""
    hooks = hooks or BuildHooks()
    if layout.threads:
        import torch

        torch.set_num_threads(layout.threads)
    if hooks.comm is not None:
        return _tp_head(Path(model), hooks.comm, layout, limits, hooks, "the given group")
    if layout.ring_config is not None:
        return _remote_tp_head(Path(model), layout, limits, hooks)
    if layout.world_size == 1:
        return _single(model, layout, limits, hooks)
    from tandem.kernels import library

    # the native kernels' first build (every ISA variant: a minute on 2 cores) happens here, once,
    # rather than in every rank started below at once, each within its start-up timeout
    with hooks.status("building the native kernels (once per CPU and tandem version)"):
        library.available()
    if layout.pp == 1:
        from tandem.engine.tp.local import launch_local_tp

        with hooks.status(f"starting {layout.tp} ranks, loading their shards, forming the group"):
            ex = launch_local_tp(
                model,
                layout.tp,
                weights=layout.tp_weights,
                attn_ranks=layout.attn_ranks,
                moe=layout.moe,
                dtypes=layout.dtype_names(),
                devices=layout.device_names(),
                max_batch=limits.max_batch,
                max_seq_len=limits.max_seq_len,
                op_timeout=layout.op_timeout,
                heartbeat_timeout=layout.heartbeat_timeout,
                threads=layout.threads,  # an idle group pings every keepalive_interval(op_timeout)
                epoch=hooks.epoch,
                keep=_kept(hooks),
            )
        hooks.notice(ex.placement)  # the TP weights chosen and why
        return ex
    from tandem.engine.pp.launch import launch_pipeline
    from tandem.engine.pp.layout import describe_auto, plan_stages, ranks_differ

    config = (hooks.source or open_model(model)).config
    # layer ranges by stage speed (its TP degree), the head's LM head counted against stage 0;
    # under "auto" (asked, or the default where the ranks differ) these are replaced by ranges
    # from the probes the stages run before loading
    auto = layout.pp_weights == "auto"
    stages = plan_stages(
        config,
        layout.stage_tp,
        pp_weights=None if auto else layout.pp_weights,
        dtype=",".join(layout.dtype_names()),
        device=",".join(layout.device_names()),
    )
    why = "--pp-weights auto" if auto else None
    if layout.pp_weights is None:
        why = ranks_differ(stages)
        auto = why is not None
    with hooks.status(f"starting {layout.world_size} ranks in {layout.pp} stages"):
        executor = launch_pipeline(
            model,
            stages,
            max_batch=limits.max_batch,
            max_seq_len=limits.max_seq_len,
            wire_dtype=layout.wire_dtype,
            microbatches=layout.microbatches,
            threads=layout.threads,
            auto_layers=auto,
            timeout=layout.op_timeout,
            heartbeat_timeout=layout.heartbeat_timeout,
            addresses=hooks.addresses,
            argv_prefix=hooks.argv_prefix,
        )
    if auto:
        hooks.notice(f"{describe_auto(executor.stages, executor.stage_probes)} ({why})")
    return executor


def _single(model: str | Path, layout: Layout, limits: Limits, hooks: BuildHooks) -> Executor:
    from tandem.engine.local import LocalExecutor
    from tandem.kernels import mapped_guard
    from tandem.loaders.file_identity import ModelFiles
    from tandem.loaders.load import load_model
    from tandem.parallel.moe_reads import whole_model_entry

    source = hooks.source or open_model(model)
    check_fits_alone(source, layout, limits)  # before minutes of loading, not after
    files = ModelFiles.of_source(source)
    weights = load_model(source, dtype=layout.dtypes[0], device=layout.devices[0])
    mapped_guard.watch(source)  # a GGUF's blocks stay mapped: a SIGBUS on them is named
    return LocalExecutor(
        weights,
        max_batch=limits.max_batch,
        max_seq_len=limits.max_seq_len,
        weight_format=source.weight_format(),
        experts=whole_model_entry(source),
        files=files,
    )


def _remote_tp_head(model: Path, layout: Layout, limits: Limits, hooks: BuildHooks) -> Executor:
    from tandem.cluster.ring_config import epoch_cluster_id, keepalive_interval, load_ring_config
    from tandem.comm import from_env

    ring_config = layout.ring_config
    assert ring_config is not None
    cfg = load_ring_config(ring_config)
    # pings inside the workers' op timeout (the ring's own, from the same file), however short
    keepalive_s = keepalive_interval(cfg.op_timeout)
    env = {**os.environ, "RING_CONFIG": str(ring_config)}
    if hooks.epoch:  # formed again after a loss: the workers claim this epoch (`worker --epoch`)
        base = env.get("TANDEM_CLUSTER_ID") or cfg.cluster_id
        env["TANDEM_CLUSTER_ID"] = epoch_cluster_id(base, hooks.epoch)
    with hooks.status(f"waiting for the ring of {ring_config} to form (workers joining)"):
        # no fingerprint claim: the workers (`tandem worker`, `cluster join`) make none; the
        # layout agreement (`tp.setup.agree_layout`) compares the model's fingerprint instead
        comm = from_env(env, handshake_timeout=hooks.handshake_timeout)
    rtts = join_rtts(os.environ.get("TANDEM_JOIN_RTT_MS", ""), comm.world_size)
    kept = _kept(hooks)
    if kept is not None:
        from tandem.engine.tp.rejoin import rejoin_head

        # the returning workers load their shards under the handshake's bound, not a step's
        return rejoin_head(
            model,
            kept,
            comm,
            keepalive_s=keepalive_s,
            join_rtt_ms=rtts,
            setup_timeout=cfg.handshake_timeout,
        )
    return _tp_head(model, comm, layout, limits, hooks, str(ring_config), keepalive_s, rtts)


def _kept(hooks: BuildHooks) -> TPExecutor | None:
    """The TP head whose shard a group formed again keeps (`hooks.keep`), if it can be kept."""
    if hooks.keep is None:
        return None
    from tandem.engine.tp.rejoin import keepable

    return keepable(hooks.keep)


def _tp_head(
    model: Path,
    comm: Communicator,
    layout: Layout,
    limits: Limits,
    hooks: BuildHooks,
    where: str,
    keepalive_s: float | None = None,
    join_rtt_ms: dict[int, float] | None = None,
) -> Executor:
    """Rank 0 of the TP group over `comm` (its workers run `tp.setup.run_worker`), metered;
    `where` names the group in errors."""
    from tandem.comm.metered import MeteredCommunicator
    from tandem.engine.tp.setup import start_head

    if comm.rank != 0:
        comm.close()
        raise LayoutUnavailable(f"{where} is rank {comm.rank}: only rank 0 runs the head")
    if layout.tp > 1 and comm.world_size != layout.tp:
        comm.close()
        raise LayoutUnavailable(
            f"{where} describes {comm.world_size} ranks but the layout has {layout.tp}"
        )
    metered = MeteredCommunicator(comm)
    with hooks.status(f"agreeing on the model with {comm.world_size - 1} worker(s)"):
        ex = start_head(
            model,
            metered,
            weights=layout.tp_weights,
            attn_ranks=layout.attn_ranks,
            moe=layout.moe,
            max_batch=limits.max_batch,
            max_seq_len=limits.max_seq_len,
            dtype=layout.dtype_names()[0],
            device=layout.device_names()[0],
            keepalive_s=keepalive_s,
            join_rtt_ms=join_rtt_ms,
        )
    hooks.notice(ex.placement)  # the TP weights chosen and why
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


def check_fits_alone(source: ModelSource, layout: Layout, limits: Limits) -> None:
    """Raises `PlanDoesNotFitError` (naming the bytes) when the whole model in the layout's first
    dtype, with its KV cache at `limits`, does not fit the first device's free memory: what a
    single node checks before it loads or allocates anything, and a group shrinking onto its head
    alone before it loads (`parallel.fit.check_node`)."""
    import torch

    from tandem.engine.device_probe import free_gb
    from tandem.parallel.fit import check_node, rank_needs
    from tandem.parallel.plan import plan_for_config

    cfg = source.config
    elem = torch.tensor([], dtype=layout.dtypes[0]).element_size()
    fmt = source.weight_format()
    dense = fmt.startswith("safetensors") and "quantized" not in fmt
    seq_len = min(limits.max_seq_len, cfg.max_position_embeddings)
    (whole,) = rank_needs(
        cfg,
        plan_for_config(cfg, 1),
        elem_bytes=[elem],
        weight_bytes_per_elem=[elem if dense else 0],  # a file's blocks stay mapped
        free_bytes=[0],
        max_batch=limits.max_batch,
        max_seq_len=seq_len,
    )
    check_node(
        cfg,
        kv_elem_bytes=elem,
        weight_bytes=whole.weight_bytes,
        free_bytes=int(free_gb(torch.device(layout.devices[0])) * 1e9),
        max_batch=limits.max_batch,
        max_seq_len=seq_len,
    )
