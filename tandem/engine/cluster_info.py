"""What an executor says about itself: the plain, JSON-ready dict behind `Executor.describe()`.

Every executor (one device, a TP group, a pipeline) answers with the same shape, so the server
(`/v1/cluster`, `/metrics`, the web page) reads one document whatever the layout:

    {"layout":   {"kind": "single" | "tp" | "pp", "tp": N, "pp": M, "world_size": N*M},
     "state":    "forming" | "whole" | "re-forming" | "failed",
     "detail":   one line for a person,
     "ranks":    [rank entries, global rank order],
     "links":    [{"a": r, "b": s, "kind": "ring" | "stage", "rtt_ms": x | None,
                   "goodput_mbit_s": x | None}],
     "counters": {"wait_seconds": s, "wire_bytes": n, "collectives": n}}   the head's, cumulative

A rank entry is `RankFacts.entry()`: who (rank, role, host, pid), on what (device, compute dtype,
threads, the stored weight format), holding what (`shard`: layers, and for a TP rank its kv heads,
query heads, MLP rows, a hybrid's DeltaNet heads and vocabulary rows, all half-open `[start, end)`;
the single node adds `cache_bytes_per_sequence`, {"kv": keys and values at max_seq_len, "state":
the recurrent layers' fixed state}, as its cache allocated them), `work_share` (the rank's
fraction of each token's weight work, from the plan), `rss_bytes` (resident memory, read live
for processes on this host, None where unknown) and `kernels` (the CPU, and the ISA build each
weight type's GEMV took, decode and prefill, with the timings that chose it:
`tandem.kernels.variant_choice`; None where the rank runs no native kernels or did not say). A
figure nobody measured is None, never a guess.
query heads, MLP rows and vocabulary rows, all half-open `[start, end)`), `work_share` (the rank's
fraction of each token's weight work, from the plan) and `rss_bytes` (resident memory, read live
for processes on this host, None where unknown). A figure nobody measured is None, never a guess.

A mixture-of-experts model's rank entry also carries `experts` (None for a dense model): the
experts it holds and its rows of each, the bytes it reads per token at the file's block types
(attention, router, its expected share of the top-k experts, shared expert, dense MLP) and the
expert bytes it holds (`parallel.moe_reads.RankReads.entry`; the expert term under `--moe experts`
is the uniform-routing expectation k n_r / E, stated there).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from tandem.parallel.moe_reads import ElementBytes, rank_reads
from tandem.parallel.plan import TPPlan, plan_for_config

STATES = ("forming", "whole", "re-forming", "failed")


@dataclass(frozen=True)
class RankFacts:
    """The static facts of one rank, fixed when the group forms. `pid` is read for memory only
    when `local` (a process of this host that this head started or is)."""

    rank: int
    role: str  # "head", "worker", "stage k"
    host: str
    device: str
    dtype: str
    weight_format: str | None
    shard: dict[str, Any]
    work_share: float | None = None
    pid: int | None = None
    local: bool = False
    threads: int | None = None
    probe: dict[str, float] | None = None  # what the rank measured of itself at join (tp/probe)
    kernels: dict[str, Any] | None = None  # the ISA build each weight type took (variant_choice)
    experts: dict[str, Any] | None = None  # a mixture of experts' placement (module docstring)

    def entry(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "role": self.role,
            "host": self.host,
            "pid": self.pid,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "weight_format": self.weight_format,
            "shard": dict(self.shard),
            "work_share": self.work_share,
            "rss_bytes": rss_bytes(self.pid) if self.local else None,
            "probe": self.probe,
            "kernels": self.kernels,
            "experts": None if self.experts is None else dict(self.experts),
        }


@dataclass
class Counters:
    """The head's cumulative figures: seconds waiting on peers (collectives or the last stage's
    answer, transfer included), bytes it put on the wire, collectives run."""

    wait_seconds: float = 0.0
    wire_bytes: int = 0
    collectives: int = 0

    def entry(self) -> dict[str, Any]:
        return {
            "wait_seconds": self.wait_seconds,
            "wire_bytes": self.wire_bytes,
            "collectives": self.collectives,
        }


@dataclass
class Description:
    kind: str
    tp: int
    pp: int
    ranks: list[RankFacts]
    state: str = "whole"
    detail: str = "every rank is up"
    links: list[dict[str, Any]] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)
    world_size: int | None = None  # default: one per rank entry

    def as_dict(self) -> dict[str, Any]:
        if self.state not in STATES:
            raise ValueError(f"cluster state {self.state!r} is not one of {STATES}")
        world = len(self.ranks) if self.world_size is None else self.world_size
        return {
            "layout": {"kind": self.kind, "tp": self.tp, "pp": self.pp, "world_size": world},
            "state": self.state,
            "detail": self.detail,
            "ranks": [r.entry() for r in self.ranks],
            "links": [dict(x) for x in self.links],
            "counters": self.counters.entry(),
        }


def hostname() -> str:
    return socket.gethostname()


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of `pid` on this host, or None when it is gone or unreadable."""
    if pid is None:
        return None
    with contextlib.suppress(psutil.Error, OSError):
        return int(psutil.Process(pid).memory_info().rss)
    return None


def link(a: int, b: int, kind: str, rtt_ms: float | None = None) -> dict[str, Any]:
    """A link between ranks `a` and `b`; goodput stays None until something measures it."""
    return {"a": a, "b": b, "kind": kind, "rtt_ms": rtt_ms, "goodput_mbit_s": None}


def ring_links(ranks: Sequence[int]) -> list[dict[str, Any]]:
    """A TP ring's links, each rank to the next (one link when there are two ranks)."""
    n = len(ranks)
    if n < 2:
        return []
    return [link(ranks[i], ranks[(i + 1) % n], "ring") for i in range(n if n > 2 else 1)]


def pipeline_links(grid: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """A pipeline's links: each stage's leader to every rank of the next stage, the last stage's
    leader back to the head, and each TP stage's ring."""
    out = [link(grid[k][0], g, "stage") for k in range(len(grid) - 1) for g in grid[k + 1]]
    if len(grid) > 1:
        out.append(link(grid[-1][0], grid[0][0], "stage"))
    for ranks in grid:
        out += ring_links(ranks)
    return out


def tp_shard(
    plan: TPPlan, rank: int, layers: tuple[int, int], *, vocab: bool = True
) -> dict[str, Any]:
    """TP rank `rank`'s part of layers `[start, end)`: its heads and MLP rows, a mixture of
    experts' placement (its experts and rows of each), and its vocabulary rows when the group
    shards the embedding and LM head (`vocab`)."""
    kv, q, mlp = plan.kv_heads[rank], plan.q_heads(rank), plan.intermediate[rank]
    out = {
        "layers": list(layers),
        "tp_rank": rank,
        "tp_size": plan.world_size,
        "kv_heads": [kv.start, kv.end],
        "q_heads": [q.start, q.end],
        "mlp_rows": [mlp.start, mlp.end],
    }
    if plan.expert_groups:
        e = plan.held_experts(rank)
        out["moe"] = plan.moe
        out["experts"] = [e.start, e.end]
        out["expert_groups"] = [
            {"experts": [g.experts.start, g.experts.end], "rows": [g.rows.start, g.rows.end]}
            for g in plan.expert_groups[rank]
        ]
    if plan.linear_k_heads:  # a hybrid's Gated DeltaNet heads (their state is this rank's)
        k, v = plan.linear_k_heads[rank], plan.linear_v_heads(rank)
        out["linear_k_heads"] = [k.start, k.end]
        out["linear_v_heads"] = [v.start, v.end]
    if vocab:
        out["vocab_rows"] = [plan.vocab[rank].start, plan.vocab[rank].end]
    return out


def experts_entry(
    config: Any,
    plan: TPPlan | None,
    rank: int,
    layers: tuple[int, int],
    nbytes: ElementBytes | None,
) -> dict[str, Any] | None:
    """Rank `rank`'s `experts` entry (module docstring) for layers `[start, end)` under `plan`
    (None: one rank holding every expert whole); None for a dense model or unknown byte sizes."""
    if getattr(config, "moe", None) is None or nbytes is None:
        return None
    reads = rank_reads(config, plan or plan_for_config(config, 1), rank, layers, nbytes)
    return None if reads is None else reads.entry()


def layer_shard(layers: tuple[int, int], stage: int = 0, n_stages: int = 1) -> dict[str, Any]:
    """A whole-width rank holding layers `[start, end)` (stage `stage` of `n_stages`)."""
    return {"layers": list(layers), "stage": stage, "n_stages": n_stages}


def layer_work(config: Any, plan: TPPlan | None = None, rank: int = 0) -> float:
    """Weight elements one layer's projections read per token on this rank:
    q and o: 2 D q_heads hd; k and v: 2 D kv_heads hd; gate, up, down: 3 D rows. A mixture of
    experts: the mean over its layers of what `parallel.moe_reads` counts (attention, router,
    the expected experts at the rank's rows, shared expert, a dense layer's MLP rows)."""
    if getattr(config, "moe", None) is not None:
        L = config.num_hidden_layers
        reads = rank_reads(config, plan or plan_for_config(config, 1), rank, (0, L), lambda _: 1)
        assert reads is not None
        return reads.active_bytes / L
    D, hd = config.hidden_size, config.head_dim
    if plan is None:
        q, kv = config.num_attention_heads, config.num_key_value_heads
        rows = config.intermediate_size
    else:
        q, kv = plan.q_heads(rank).size, plan.kv_heads[rank].size
        rows = plan.intermediate[rank].size
    return D * hd * (2 * q + 2 * kv) + 3 * D * rows


def pipeline_facts(
    config: Any,
    weight_format: str | None,
    stages: Sequence[Any],
    grid: Sequence[Sequence[int]],
    pids: dict[int, int],
    hosts: dict[int, str],
    source: Any = None,
) -> list[RankFacts]:
    """The facts of every rank of a pipeline whose processes run on this host. `stages[k]` has
    `.layers` (half-open), `.tp`, `.dtype_of(tp_rank)`, `.device`; `grid[k]` lists stage k's
    global ranks; the head (global rank 0) also holds the embedding and the LM head. `source`
    (the model source, optional): its block sizes shape a TP stage's plan, as the stage's own
    (`pp.tp_stage`), and its tensors' sizes give a mixture of experts' bytes."""
    from tandem.parallel.moe_reads import source_bytes
    from tandem.parallel.plan import plan_for_source

    n = len(stages)
    nbytes = None if source is None else source_bytes(source)
    rows: list[tuple[int, str, dict[str, Any], float, Any, str, Any]] = []
    for k, spec in enumerate(stages):
        layers = (spec.layers.start, spec.layers.end)
        plan = None
        if spec.tp > 1:
            plan = plan_for_source(source, spec.tp) if source else plan_for_config(config, spec.tp)
        for r, g in enumerate(grid[k]):
            if plan is None:
                shard = layer_shard(layers, k, n)
            else:
                shard = {**tp_shard(plan, r, layers, vocab=False), "stage": k, "n_stages": n}
            work = len(spec.layers) * layer_work(config, plan, r)
            if g == 0:
                work += config.hidden_size * config.vocab_size
            role = "head" if g == 0 else f"stage {k}"
            moe = experts_entry(config, plan, r, layers, nbytes)
            rows.append((g, role, shard, work, spec, spec.dtype_of(r), moe))
    rows.sort(key=lambda x: x[0])
    return [
        RankFacts(
            rank=g,
            role=role,
            host=hosts.get(g) or hostname(),
            device=spec.device,
            dtype=dtype,
            weight_format=weight_format,
            shard=shard,
            work_share=share,
            pid=pids.get(g),
            local=g in pids,
            experts=moe,
        )
        for (g, role, shard, _, spec, dtype, moe), share in zip(rows, shares([x[3] for x in rows]))
    ]


def shares(work: list[float]) -> list[float | None]:
    """Each rank's fraction of the whole group's work."""
    total = sum(work)
    return [w / total if total > 0 else None for w in work]
