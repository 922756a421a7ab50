"""`GET /v1/cluster`: one JSON document with who runs what and how fast, and the same figures as
Prometheus series for `/metrics`.

Everything comes from `ServingEngine.cluster()` (the executor's `describe()` plus the scheduler's
counters). Rates are differences of cumulative counters between samples the monitor keeps (one per
`MIN_INTERVAL_S` at most, taken when someone asks): tokens/s per interval for the plot, and over
the last `WINDOW_S` the head's wait for its peers as a fraction of its step time. A figure nobody
measured is null (the page shows "—"), never a guess.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from tandem.engine.serving import ServingEngine

MIN_INTERVAL_S = 0.5
WINDOW_S = 10.0
KEEP = 240  # samples: two minutes at the page's one-second poll

State = Literal["forming", "whole", "re-forming", "failed"]


class ExpertGroup(BaseModel):
    """Experts [start, end) of which a rank holds rows [start, end) of each (`TPPlan.expert_groups`)."""

    experts: list[int]
    rows: list[int]


class Shard(BaseModel):
    """What a rank holds. Ranges are half-open `[start, end)`; absent fields do not apply."""

    layers: list[int] = Field(description="layer range [start, end)")
    stage: int | None = None
    n_stages: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    kv_heads: list[int] | None = None
    q_heads: list[int] | None = None
    mlp_rows: list[int] | None = None
    vocab_rows: list[int] | None = None
    linear_k_heads: list[int] | None = Field(None, description="Gated DeltaNet q/k heads")
    linear_v_heads: list[int] | None = Field(None, description="Gated DeltaNet v heads")
    cache_bytes_per_sequence: dict[str, int] | None = Field(
        None,
        description='one sequence\'s cache slot: {"kv": keys and values at max_seq_len, '
        '"state": the recurrent (Gated DeltaNet) layers\' fixed state}',
    )
    moe: Literal["tp", "experts"] | None = Field(
        default=None, description="a TP rank's expert placement: rows of every expert or whole"
    )
    experts: list[int] | None = Field(
        default=None, description="experts held (whole or in part) [start, end)"
    )
    expert_groups: list[ExpertGroup] | None = Field(
        default=None, description="its groups of experts and the rows it holds of each"
    )


class ActiveBytes(BaseModel):
    """A rank's bytes read per token, by part, at the file's block types."""

    attention: int
    router: int
    experts: int = Field(description="expected: k n_r / E experts' worth under whole experts")
    shared_expert: int
    dense_mlp: int = Field(description="a dense layer's MLP rows among sparse ones")


class LoadedExperts(BaseModel):
    """What the rank's process holds, read from its modules once the shards loaded (TP groups)."""

    groups: list[list[int]] = Field(
        description="per group of experts: [first, end, rows of each] as its modules hold them"
    )
    sparse_layers: int
    bytes: int = Field(description="its expert tensors' bytes as loaded (biases included)")


class RankExperts(BaseModel):
    """A mixture of experts' placement on one rank (`parallel.moe_reads`)."""

    moe: Literal["tp", "experts"]
    experts: list[int] = Field(description="experts held (whole or in part) [start, end)")
    n_experts: int
    expert_groups: list[ExpertGroup] = Field(
        description="its groups of experts and the rows it holds of each (one unless the "
        "expert width's blocks do not divide evenly over the ranks)"
    )
    row_share: float = Field(description="its rows over the held experts' rows")
    active_experts: float = Field(description="experts' worth read per token per sparse layer")
    active_bytes_per_token: int = Field(description="decoder weights read per token, bytes")
    active_bytes: ActiveBytes
    held_expert_bytes: int = Field(description="its experts' bytes as stored in the file")
    loaded: LoadedExperts | None = None


class Rank(BaseModel):
    rank: int
    role: str = Field(description='"head", "worker" or "stage k"')
    host: str
    pid: int | None
    device: str
    dtype: str = Field(description="compute dtype")
    threads: int | None
    weight_format: str | None = Field(description='how the weights are stored: "safetensors BF16"')
    shard: Shard
    work_share: float | None = Field(description="fraction of each token's weight work (plan)")
    rss_bytes: int | None = Field(description="resident memory, live; null where not readable")
    wait_fraction: float | None = Field(
        description="share of step time spent waiting on peers over the last window (head only)"
    )
    probe: dict[str, float] | None = Field(
        default=None,
        description="measured on the rank as its TP group formed: gemv_gb_s (decode GEMV weight "
        "GB/s on its own kernel and dtype), free_gb, allreduce_ms and goodput_mbit_s (the group's)",
    )
    experts: RankExperts | None = Field(
        default=None, description="a mixture of experts' placement on this rank; null if dense"
    )


class Link(BaseModel):
    a: int
    b: int
    kind: str = Field(description='"ring" (TP) or "stage" (PP)')
    rtt_ms: float | None
    goodput_mbit_s: float | None


class Sample(BaseModel):
    t: float = Field(description="unix time at the end of the interval")
    tokens_per_s: float = Field(description="tokens generated per second over the interval")


class Layout(BaseModel):
    kind: Literal["single", "tp", "pp"]
    tp: int
    pp: int
    world_size: int


class PrefixCacheView(BaseModel):
    """The prefix cache (`tandem.engine.prefix_cache`) as the scheduler counts it."""

    hits: int = Field(description="requests that continued or copied a cached sequence")
    misses: int = Field(description="requests that found none sharing enough of their prompt")
    reused_tokens: int = Field(
        description="prompt tokens taken from the cache (continued or copied), not prefilled"
    )
    copies: int = Field(
        0, description="hits served by copying a shared prefix into a fresh KV cache slot"
    )
    evictions: int = Field(description="kept sequences released for a request needing a slot")
    entries: int = Field(description="finished sequences kept now (each holds a KV cache slot)")
    held_tokens: int = Field(description="tokens the kept sequences hold")
    held_blocks: int = Field(
        0, description="KV cache blocks the kept and running sequences hold, a shared one once"
    )
    cache_bytes: int = Field(
        0, description="bytes of the blocks only kept sequences hold (what --cache-mem bounds)"
    )


class ClusterView(BaseModel):
    """The document `GET /v1/cluster` returns."""

    model: str
    state: State
    detail: str
    layout: Layout
    ranks: list[Rank]
    links: list[Link]
    running: int
    waiting: int
    generated_tokens: int
    tokens_per_s: float | None = Field(description="over the latest interval")
    decode_ms_per_step: float | None = Field(description="decode-only steps, last window")
    wait_seconds: float = Field(description="head's cumulative wait on peers")
    wire_bytes: int = Field(description="bytes the head put on the wire, cumulative")
    history: list[Sample]
    time: float
    balance: dict[str, Any] | None = Field(
        default=None,
        description="a TP group's compute as measured in service: steps, compute_ms_per_step per "
        "rank (waits left out), the weights now and balanced_weights, the TP weights that would "
        "equalize it (engine/tp/balance.py)",
    )
    prefix_cache: PrefixCacheView | None = Field(
        default=None, description="the prefix cache's counters; null when it is off"
    )


@dataclass(frozen=True)
class _Point:
    t: float
    tokens: int
    steps: int
    step_s: float
    decode_steps: int
    decode_s: float
    wait_s: float


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class ClusterMonitor:
    """Builds `ClusterView`s and keeps the samples the rates come from. Thread-safe."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self._points: deque[_Point] = deque(maxlen=KEEP)
        self._lock = threading.Lock()

    def view(self) -> ClusterView:
        snap: dict[str, Any] = self.engine.cluster()
        s, c = snap["scheduler"], snap["counters"]
        now = time.time()
        point = _Point(
            now,
            s["generated_tokens"],
            s["steps"],
            s["step_seconds"],
            s["decode_steps"],
            s["decode_seconds"],
            c["wait_seconds"],
        )
        with self._lock:
            if not self._points or now - self._points[-1].t >= MIN_INTERVAL_S:
                self._points.append(point)
            points = list(self._points)
        history = [
            Sample(t=b.t, tokens_per_s=(b.tokens - a.tokens) / (b.t - a.t))
            for a, b in zip(points, points[1:])
        ]
        recent = [p for p in points if now - p.t <= WINDOW_S] or [point]
        first, last = recent[0], point
        wait = _ratio(last.wait_s - first.wait_s, last.step_s - first.step_s)
        decode_s = _ratio(last.decode_s - first.decode_s, last.decode_steps - first.decode_steps)
        if snap["layout"]["world_size"] < 2:
            wait = None  # no peers to wait for
        ranks = [Rank(**r, wait_fraction=wait if r["rank"] == 0 else None) for r in snap["ranks"]]
        return ClusterView(
            model=self.engine.model_name,
            state=snap["state"],
            detail=snap["detail"],
            layout=Layout(**snap["layout"]),
            ranks=ranks,
            links=[Link(**x) for x in snap["links"]],
            running=s["running"],
            waiting=s["waiting"],
            generated_tokens=s["generated_tokens"],
            tokens_per_s=history[-1].tokens_per_s if history else None,
            decode_ms_per_step=None if decode_s is None else decode_s * 1e3,
            wait_seconds=c["wait_seconds"],
            wire_bytes=c["wire_bytes"],
            history=history,
            time=now,
            balance=snap.get("balance"),
            prefix_cache=s.get("prefix_cache"),
        )


def _label(value: Any) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def shard_text(s: Shard) -> str:
    parts = [f"layers [{s.layers[0]}, {s.layers[1]})"]
    if s.stage is not None and (s.n_stages or 1) > 1:
        parts.insert(0, f"stage {s.stage}/{s.n_stages}")
    if s.tp_size and s.tp_size > 1:
        parts.append(f"tp {s.tp_rank}/{s.tp_size}")
        for name, rng in (("kv heads", s.kv_heads), ("mlp rows", s.mlp_rows)):
            if rng is not None:
                parts.append(f"{name} [{rng[0]}, {rng[1]})")
    return " ".join(parts)


def render_cluster_metrics(v: ClusterView) -> str:
    """The cluster view as Prometheus text (appended to /metrics). Unmeasured figures are left
    out rather than written as zero."""
    out: list[str] = []

    def family(name: str, kind: str, help_: str, rows: list[tuple[dict[str, Any], float]]) -> None:
        if not rows:
            return
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        for labels, value in rows:
            text = ",".join(f'{k}="{_label(x)}"' for k, x in labels.items())
            out.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")

    family(
        "tandem_cluster_state",
        "gauge",
        "1 for the cluster's current state (forming, whole, re-forming, failed).",
        [({"state": st}, int(st == v.state)) for st in State.__args__],
    )
    info = []
    for r in v.ranks:
        labels = {"rank": r.rank, "role": r.role, "host": r.host, "device": r.device}
        labels |= {
            "dtype": r.dtype,
            "weight_format": r.weight_format or "",
            "shard": shard_text(r.shard),
        }
        info.append((labels, 1))
    family("tandem_rank_info", "gauge", "What each rank is and holds (value 1).", info)

    def per_rank(attr: str) -> list[tuple[dict[str, Any], float]]:
        return [
            ({"rank": r.rank}, getattr(r, attr)) for r in v.ranks if getattr(r, attr) is not None
        ]

    family(
        "tandem_rank_work_share",
        "gauge",
        "Fraction of each token's weight work.",
        per_rank("work_share"),
    )
    family(
        "tandem_rank_resident_memory_bytes", "gauge", "Resident memory of the rank's process.",
        per_rank("rss_bytes"),
    )  # fmt: skip
    family(
        "tandem_rank_wait_fraction", "gauge",
        "Share of step time spent waiting on peers over the last window.", per_rank("wait_fraction"),
    )  # fmt: skip
    if v.balance is not None:
        family(
            "tandem_rank_balanced_weight", "gauge",
            "TP weight that would balance the ranks' compute measured in service.",
            [({"rank": r}, w) for r, w in enumerate(v.balance["balanced_weights"])],
        )  # fmt: skip
    links = [({"a": x.a, "b": x.b}, x.rtt_ms / 1e3) for x in v.links if x.rtt_ms is not None]
    family("tandem_link_rtt_seconds", "gauge", "Round-trip time of a link.", links)
    good = [
        ({"a": x.a, "b": x.b}, x.goodput_mbit_s * 1e6)
        for x in v.links
        if x.goodput_mbit_s is not None
    ]
    family("tandem_link_goodput_bits_per_second", "gauge", "Measured goodput of a link.", good)
    family(
        "tandem_head_wait_seconds_total", "counter",
        "Seconds the head waited on its peers (collectives or the last stage).",
        [({}, v.wait_seconds)],
    )  # fmt: skip
    if v.tokens_per_s is not None:
        family(
            "tandem_tokens_per_second", "gauge", "Tokens generated per second, latest interval.",
            [({}, v.tokens_per_s)],
        )  # fmt: skip
    return "\n".join(out) + "\n"
