"""Forming a tensor-parallel group over a communicator: agree on the layout, load the shards.

The head decides the layout (TP weights, batch slots, sequence length) and broadcasts it; a worker
needs only the model directory and its own device and dtype, the same on one machine or many.
Every rank then checks that it holds the same model (the fingerprint of config + tensor manifest):
a mismatch fails on every rank at once, naming the ranks that differ. Then each rank builds its
shard and reads only its own slices (`tandem.parallel.shard_load`).

    setup frame (int64, SETUP_LEN):  [MAGIC, VERSION, world_size, max_batch, max_seq_len,
                                      attn_ranks, probed, moe, fingerprint as 4 int64 words]
                                      (moe: the index of the MoE placement in MOE_PLACEMENTS)
    probe (float32, gathered)         before the layout: each rank's decode GEMV speed, free memory,
                                      and the group's all-reduce latency and goodput (`tp.probe`)
    rank info (int64, gathered)       each rank's compute dtype, device kind, CPU threads, pid,
                                      CFS quota (milli-CPUs, 0: none) and host name (HOST_BYTES of
                                      UTF-8, zero-padded): what the head chooses the weights from
                                      (`tp.probe.choose_weights`), for reports and the cluster view
    weights (float32, world_size)     the plan's weights, as every rank will use them
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tandem.comm.base import Communicator
from tandem.comm.metered import MeteredCommunicator
from tandem.devices import DTYPE_NAMES
from tandem.engine import cluster_info as ci
from tandem.engine.device_probe import cpu_quota
from tandem.engine.runner import ShardRunner
from tandem.engine.tp.balance import ComputeClock
from tandem.engine.tp.conformance import check_conformance
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.held_experts import gather_held
from tandem.engine.tp.layout import GroupLayout, RankInfo, WorkerProcesses
from tandem.engine.tp.placement import check_group_fit, plannable, refinement
from tandem.engine.tp.probe import RankProbe, choose_weights, measure
from tandem.engine.tp.refine import agree_refinement, warmup_clocks
from tandem.kernels.prepare import prepare
from tandem.loaders.source import ModelSource, open_model
from tandem.parallel.plan import MOE_PLACEMENTS, TPPlan, plan_for_source
from tandem.parallel.shard_load import load_shard, quant_types
from tandem.parallel.transform import shard_transformer

log = logging.getLogger(__name__)

MAGIC = 0x54414E44534554  # "TANDSET"
VERSION = 5  # 2: rank info carries pid and host name; 3: attention ranks; 4: the probe first;
# 5: rank info, with the CFS quota, before the layout
SETUP_LEN = 12
HOST_BYTES = 64
DTYPE_CODES = ("float32", "bfloat16", "float16")  # the setup frame's dtype code: index here
DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu")


class GroupSetupError(RuntimeError):
    """The ranks of a group disagree (model, protocol version) or the layout is invalid."""


def _fp_words(fingerprint: str) -> list[int]:
    raw = bytes.fromhex(fingerprint)[:32].ljust(32, b"\0")
    return list(struct.unpack("<4q", raw))


def _f32(weights: tuple[float, ...]) -> tuple[float, ...]:
    """The weights as they survive the float32 wire, so the head plans with the workers' values."""
    return tuple(torch.tensor(weights, dtype=torch.float32).tolist())


def agree_layout(comm: Communicator, layout: GroupLayout | None, fingerprint: str) -> GroupLayout:
    """Rank 0 passes its `layout`; the others pass None and receive it. Every rank passes its own
    model `fingerprint`; any disagreement raises `GroupSetupError` on every rank."""
    head = comm.rank == 0
    frame = torch.zeros(SETUP_LEN, dtype=torch.int64)
    if head:
        assert layout is not None
        vals = [MAGIC, VERSION, layout.world_size, layout.max_batch, layout.max_seq_len]
        vals += [layout.attn_ranks, layout.probed, MOE_PLACEMENTS.index(layout.moe)]
        frame = torch.tensor(vals + _fp_words(layout.fingerprint), dtype=torch.int64)
    frame = comm.broadcast(frame, 0)
    if int(frame[0]) != MAGIC:
        raise GroupSetupError("the head's setup frame has the wrong magic: not a tandem head?")
    n = int(frame[2])
    weights_t = torch.zeros(n, dtype=torch.float32)
    if head:
        weights_t = torch.tensor(layout.weights, dtype=torch.float32)
    weights_t = comm.broadcast(weights_t, 0)
    mine = (
        int(frame[1]) != VERSION
        or n != comm.world_size
        or frame[8:].tolist() != _fp_words(fingerprint)
    )
    flags = comm.all_gather(torch.tensor([int(mine)], dtype=torch.int64), 0).tolist()
    bad = [r for r, f in enumerate(flags) if f]
    if bad:
        raise GroupSetupError(
            f"rank(s) {bad} disagree with the head on the model (fingerprint of config + tensor "
            f"manifest), the protocol version or the group size: every rank must hold the same "
            f"model directory and run the same tandem version"
        )
    return GroupLayout(
        n,
        tuple(weights_t.tolist()),
        int(frame[3]),
        int(frame[4]),
        fingerprint,
        int(frame[5]),
        int(frame[6]),
        MOE_PLACEMENTS[int(frame[7])] if 0 <= int(frame[7]) < len(MOE_PLACEMENTS) else "?",
    )


def _host_words(host: str) -> list[int]:
    raw = host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    return list(struct.unpack(f"<{HOST_BYTES // 8}q", raw))


def _host_text(words: list[int]) -> str:
    raw = struct.pack(f"<{HOST_BYTES // 8}q", *words)
    return raw.rstrip(b"\0").decode(errors="replace")


def _quota_milli() -> int:
    try:
        quota = cpu_quota()
    except (OSError, ValueError):
        return 0
    return 0 if quota is None else max(1, round(quota[0] * 1000))


def exchange_rank_info(comm: Communicator, dtype: str, device: str) -> list[RankInfo]:
    """Every rank's compute dtype, device kind, CPU threads, pid, CFS quota and host name,
    gathered on every rank (for the weights' choice, reports and the cluster view)."""
    kind = torch.device(device).type
    mine = torch.tensor(
        [
            DTYPE_CODES.index(dtype),
            DEVICE_KINDS.index(kind) if kind in DEVICE_KINDS else -1,
            torch.get_num_threads(),
            os.getpid(),
            _quota_milli(),
            *_host_words(socket.gethostname()),
        ],
        dtype=torch.int64,
    )
    rows = comm.all_gather(mine[None], 0).tolist()
    return [
        RankInfo(
            r,
            DTYPE_CODES[d],
            DEVICE_KINDS[k] if k >= 0 else "other",
            t,
            pid,
            _host_text(host),
            quota / 1000,
        )
        for r, (d, k, t, pid, quota, *host) in enumerate(rows)
    ]


def rank_facts(
    md: ModelSource,
    plan: TPPlan,
    ranks: list[RankInfo],
    head_device: str,
    loaded: list[dict[str, Any] | None] | None = None,
) -> list[ci.RankFacts]:
    """The cluster view's static facts of each rank of a TP group holding every layer. Only the
    head (this process) is marked local; a launcher that started its workers marks them.
    `loaded`: what each rank's shard holds of the experts (`held_experts.gather_held`), shown
    beside the plan's placement."""
    from tandem.parallel.moe_reads import source_bytes

    cfg = md.config
    nbytes = source_bytes(md)
    layers = (0, cfg.num_hidden_layers)
    work = [
        cfg.num_hidden_layers * ci.layer_work(cfg, plan, r.rank)
        + cfg.hidden_size * plan.vocab[r.rank].size
        for r in ranks
    ]
    return [
        ci.RankFacts(
            rank=r.rank,
            role="head" if r.rank == 0 else "worker",
            host=r.host,
            device=head_device if r.rank == 0 else r.device,
            dtype=r.dtype,
            weight_format=md.weight_format(),
            shard=ci.tp_shard(plan, r.rank, layers),
            work_share=share,
            pid=r.pid,
            local=r.rank == 0,
            threads=r.threads,
            experts=_with_loaded(
                ci.experts_entry(cfg, plan, r.rank, layers, nbytes), loaded, r.rank
            ),
        )
        for r, share in zip(ranks, ci.shares(work))
    ]


def _with_loaded(entry, loaded, rank: int):
    if entry is None or loaded is None:
        return entry
    return {**entry, "loaded": loaded[rank]}


def _reload(
    model_dir: str | Path,
    comm: Communicator,
    layout: GroupLayout,
    weights: tuple[float, ...],
    ranks: list[RankInfo],
    probes: list[RankProbe],
    dtype: str,
    device: str,
    kernels: str,
) -> tuple[GroupLayout, ShardRunner, list[dict[str, Any] | None]]:
    """Every rank: its shard again under the refined `weights` (the old runner let go first by
    the caller), fit-checked as the first; the kernels are those the conformance check admitted.
    Also what every rank's new shard holds of the experts (`held_experts`)."""
    gc.collect()
    layout = replace(layout, weights=weights)
    md = open_model(model_dir)
    check_group_fit(md, layout, ranks, probes)
    runner = build_shard(md, comm, layout, dtype, device, kernels)
    loaded = gather_held(comm, runner.model)  # every shard loaded again
    return layout, runner, loaded


def build_shard(
    md: ModelSource,
    comm: Communicator,
    layout: GroupLayout,
    dtype: str,
    device: str,
    kernels: str = "auto",
) -> ShardRunner:
    """This rank's shard, loaded slice by slice, with its own KV cache, put on `kernels`
    (`tandem.kernels.prepare`, as a single node: "auto" takes the native quantized kernels over
    a GGUF shard's blocks, "torch" keeps the reference modules). A rank-local choice: ranks on
    different kernels agree on the wire (canonical float32 partials)."""
    if dtype not in DTYPE_NAMES:
        raise GroupSetupError(f"dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    plan = layout.plan(md)
    model = shard_transformer(
        md.config,
        plan,
        comm,
        device=device,
        dtype=DTYPE_NAMES[dtype],
        qtypes=quant_types(md),
    ).eval()
    load_shard(model, md, plan, comm.rank)
    md.close()
    prepare(model, kernel=kernels)  # the parallel layers' `quant` modules onto the native kernels
    return ShardRunner(model, layout.max_batch, layout.max_seq_len)


@contextlib.contextmanager
def setup_bound(comm: Communicator, seconds: float | None) -> Iterator[None]:
    """Within the block every op of `comm` may wait `seconds` (when given and the backend can
    change its bound): setup waits for the slowest rank to load its shard, which a step's op
    timeout (a few seconds, to see a hung rank soon) does not bound."""
    inner = getattr(comm, "inner", comm)  # a MeteredCommunicator's backend
    set_bound = getattr(inner, "set_op_timeout", None)
    if seconds is None or not callable(set_bound):
        yield
        return
    old = set_bound(seconds)
    try:
        yield
    finally:
        set_bound(old)


def admit(
    comm: Communicator,
    runner: ShardRunner,
    ranks: list[RankInfo],
    md: ModelSource | None,
    plan: TPPlan | None,
) -> None:
    """Collective, after every shard is loaded: the numerical conformance check
    (`tandem.engine.tp.conformance`); the head passes its model source and plan and judges. A rank
    whose kernels miss the head's float64 reference fails the group on every rank."""
    check_conformance(
        comm,
        runner.model,
        md=md,
        plan=plan,
        dtypes=[r.dtype for r in ranks],
        devices=[r.device for r in ranks],
    )


def start_head(
    model_dir: str | Path,
    comm: Communicator,
    *,
    weights: tuple[float, ...] | str | None = None,
    max_batch: int = 8,
    max_seq_len: int = 2048,
    dtype: str = "float32",
    device: str = "cpu",
    on_close: Callable[[], None] | None = None,
    keepalive_s: float | None = None,
    diagnose: Callable[[], str | None] | None = None,
    local_workers: WorkerProcesses | None = None,
    join_rtt_ms: dict[int, float] | None = None,
    attn_ranks: int | None = None,
    setup_timeout: float | None = None,
    kernels: str = "auto",
    mem_limit_gb: float | None = None,
    refine: bool = True,
    moe: str = "tp",
) -> TPExecutor:
    """Rank 0: agree on the layout, load rank 0's shard, and return the group's executor.
    `local_workers`: the worker processes when this process started them (their ranks are shown as
    local, and a worker that exits marks the group failed); `join_rtt_ms`: each rank's round trip
    to the head when it joined, for `describe`; `setup_timeout`: the bound on each setup op
    (`setup_bound`; None: the op timeout). `weights="auto"`: the TP shares from every rank's
    measured decode GEMV speed (`tp.probe.auto_weights`); None: the same where the ranks differ,
    else equal (`tp.probe.choose_weights`; the choice and why are logged and shown in the group's
    health detail). `mem_limit_gb`: the most memory this rank offers (`tp.probe.measure`); a plan
    that does not fit any rank is refused before loading."""
    md = open_model(model_dir)
    with setup_bound(comm, setup_timeout):
        probes = measure(comm, device, dtype, mem_limit_gb)  # every rank, before any planning
        ranks = exchange_rank_info(comm, dtype, device)
    kinds = [r.kind() for r in ranks]
    choice = plannable(md, comm.world_size, attn_ranks, choose_weights(weights, probes, kinds), moe)
    log.info("%s", choice.line())
    weights = _f32(choice.weights)
    plan_for_source(md, comm.world_size, weights, attn_ranks, moe)  # fail before workers load
    seq = min(max_seq_len, md.config.max_position_embeddings)
    layout = GroupLayout(
        comm.world_size,
        weights,
        max_batch,
        seq,
        md.fingerprint(),
        attn_ranks or 0,
        int(choice.how == "auto" and refine),
        moe,
    )
    with setup_bound(comm, setup_timeout):
        layout = agree_layout(comm, layout, md.fingerprint())
        check_group_fit(md, layout, ranks, probes)
        runner = build_shard(md, comm, layout, dtype, device, kernels)
        loaded = gather_held(comm, runner.model)  # every shard loaded
        plan = layout.plan(md)
        ref = open_model(model_dir)  # build_shard let go of its mapping; the probe reads one layer
        try:
            admit(comm, runner, ranks, ref, plan)
        finally:
            ref.close()
        if layout.probed:
            shares = [f.work_share or 0.0 for f in rank_facts(md, plan, ranks, device)]
            clocks = warmup_clocks(comm, runner)
            new = agree_refinement(comm, refinement(md, layout, shares, clocks))
            ms = ", ".join(f"{1e3 * c / max(k, 1):.1f}" for c, k in clocks)
            if new is None:
                why = f"kept after a {clocks[0][1]}-step decode at join (compute ms/step {ms})"
            else:
                del runner
                layout, runner, loaded = _reload(
                    model_dir, comm, layout, new, ranks, probes, dtype, device, kernels
                )
                plan = layout.plan(md)
                why = (
                    f"refined by a {clocks[0][1]}-step decode at join (compute ms/step {ms}) "
                    f"from {' : '.join(f'{w:g}' for w in choice.weights)}"
                )
            choice = replace(choice, weights=layout.weights, why=f"{choice.why}; {why}")
            log.info("%s", choice.line())
    facts = [
        replace(f, probe=p.as_dict())
        for f, p in zip(rank_facts(md, plan, ranks, device, loaded), probes)
    ]
    return head_executor(
        runner,
        comm,
        md.config.vocab_size,
        facts,
        ranks,
        layout,
        probes,
        placement=choice.line(),
        local_workers=local_workers,
        on_close=on_close,
        keepalive_s=keepalive_s,
        diagnose=diagnose,
        join_rtt_ms=join_rtt_ms,
    )


def head_executor(
    runner: ShardRunner,
    comm: Communicator,
    vocab_size: int,
    facts: list,
    ranks: list[RankInfo],
    layout: GroupLayout,
    probes: list[RankProbe],
    *,
    placement: str,
    local_workers: WorkerProcesses | None,
    **kw: Any,
) -> TPExecutor:
    """The head's executor over a formed group (a first join's, or one re-formed around a kept
    shard, `tp.rejoin`): the ranks of `local_workers` shown as local, the group's all-reduce
    latency and goodput from its probe. `kw`: TPExecutor's on_close, keepalive_s, diagnose,
    join_rtt_ms."""
    if local_workers is not None:
        ours = local_workers.pids()
        facts = [replace(f, local=f.local or f.pid in ours) for f in facts]
    return TPExecutor(
        runner,
        comm,
        vocab_size,
        facts=facts,
        ranks=ranks,
        layout=layout,
        local_workers=local_workers,
        ring_probe=(probes[0].allreduce_ms, probes[0].goodput_mbit_s),
        placement=placement,
        **kw,
    )


def run_worker(
    model_dir: str | Path,
    comm: Communicator,
    *,
    dtype: str,
    device: str,
    setup_timeout: float | None = None,
    kernels: str = "auto",
    mem_limit_gb: float | None = None,
) -> int:
    """Any rank but 0: join the layout, load this rank's shard, then serve until the head stops."""
    from tandem.engine.tp.worker import BroadcastSource, serve

    if not isinstance(comm, MeteredCommunicator):  # its collective time: the clock's waits
        comm = MeteredCommunicator(comm)
    md = open_model(model_dir)
    with setup_bound(comm, setup_timeout):
        probes = measure(comm, device, dtype, mem_limit_gb)  # as the head: before any planning
        ranks = exchange_rank_info(comm, dtype, device)
        layout = agree_layout(comm, None, md.fingerprint())
        check_group_fit(md, layout, ranks, probes)
        runner = build_shard(md, comm, layout, dtype, device, kernels)
        gather_held(comm, runner.model)  # every shard loaded: the head shows what each holds
        admit(comm, runner, ranks, None, None)
        if layout.probed:  # as the head: a short decode, then the head's verdict
            warmup_clocks(comm, runner)
            new = agree_refinement(comm, None)
            if new is not None:
                del runner
                layout, runner, _ = _reload(
                    model_dir, comm, layout, new, ranks, probes, dtype, device, kernels
                )
    return serve(runner, BroadcastSource(comm), ComputeClock(comm))
