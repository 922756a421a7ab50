"""Predicted single-stream decode speed of each layout (pure functions; `tandem plan` prints them).

Inputs: per-node speed (`NodeSpec.s_per_token`, the node alone decoding the whole model, batch 1;
measured here by a short local run, or given for a node that is not here), one link (`LinkSpec`:
round trip, goodput, software cost per message), and the model's config (HF field names).

Compute. Decode is memory-bound, so a node's time splits over what it reads per token:

    t_layer(n) = s_n * c / R,   t_head(n) = s_n * h / R,   R = L c + h

(`c` params per layer, `h` = final norm + LM head, from `partition.model_cost`). A TP rank `r` with
share `f_r` of a layer (its kv heads, query heads and MLP rows under `parallel.plan`'s tiling)
works `f_r t_layer(r)`; ranks advance in lockstep, so a layer takes the slowest *host*. Ranks
that share a host (`NodeSpec.host`) share its throughput: a host runs `slots` of them at full speed
at once (1 by default: one accelerator; for CPU ranks, what k decodes at once measure, at most its
cores / threads per rank), so

    t_group = max_host max( max_{r on host} f_r t_layer(r),  sum_{r on host} f_r t_layer(r) / slots )

Lockstep waiting. TP ranks meet at every collective, so each sync also costs what the ranks lose
waiting for each other beyond that: a rank woken by its peer's data waits for a core when a host
runs more ranks than it has cores, the segments do not start together, the slowest sets the pace.
A host carries it per sync as a function of how many of the group's ranks it runs
(`NodeSpec.lockstep_s`, k -> seconds; for k unmeasured, the largest measured k' <= k; 0 for a
node given without figures, e.g. one that is not here). `lockstep.py`'s probe measures it as what
k ranks, each looping over its real shard of decoder layers with an all-reduce of S after the
attention and after the MLP, take per sync beyond this model's own terms for that work:

    p(k) = t_sync(k) - [ t_group(half a layer on k ranks of this host) + a(k) ]    (>= 0)

so p also holds the work every TP rank repeats whatever k is (norms, RoPE, attention over the
cache, op dispatch), which `t_layer` divides by k. The group pays its slowest host's: a TP stage
adds  n_syncs * max_host p_host(k_host), n_syncs = 2 n_i (+3 on the head stage), nothing for a
single rank or a PP-only layout (stages take turns).

Communication, with `m(b) = rtt/2 + b/goodput + overhead` for one message of b bytes:
  - TP over N ranks, per stage layer: 2 all-reduces of the f32 hidden state S = 4 D bytes (after
    attention and after the MLP), each as `comm.algorithms` picks it: up to 64 KB a ring all-gather
    of whole tensors, `a(N) = (N-1) m(S)`; above, reduce-scatter + all-gather, `a(N) = 2(N-1)
    m(S/N)`. On the head stage also the embedding all-reduce, the step's control broadcast (a
    frame), and the greedy argmax's all-reduce of one (max, index) pair per rank (2N floats;
    the benchmarks decode greedily, so no rank ships its logit slice).
  - PP over M stages: M activation messages per token (M-1 forward, 1 back to the head's LM head).

    t_token = sum_stages (n_i t_group_i + head work + syncs + lockstep_i) + M m(S)   (one stream:
              no overlap)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any

from tandem.comm.algorithms import DEFAULT_SMALL_MAX_BYTES, RANK_ORDER, choose_all_reduce
from tandem.parallel.partition import PartitionError, StageCapacity, model_cost, partition_layers
from tandem.parallel.plan import TPPlanError, plan_for_config

WIRE_BYTES_PER_ELEMENT = 4  # the canonical f32 wire
CONTROL_BYTES = 64  # one decode step's control frame, head -> workers (order of magnitude)


class PlanModelError(ValueError):
    """Inputs the predictor cannot use (no nodes, a non-positive speed or goodput, ...)."""


@dataclass(frozen=True)
class NodeSpec:
    """One rank's node: its time per decode token alone on the whole model, batch 1.

    Nodes with the same non-empty `host` are processes on one machine and share its throughput;
    `slots` (the same on each of them) is how many the host runs at full speed at once.
    """

    name: str
    s_per_token: float
    host: str = ""
    slots: float = 1.0
    lockstep_s: tuple[tuple[int, float], ...] = ()  # (k, seconds per sync with k ranks here)

    def __post_init__(self) -> None:
        if not self.s_per_token > 0:
            raise PlanModelError(f"node {self.name!r}: time per token must be > 0")
        if self.slots < 1:
            raise PlanModelError(f"node {self.name!r}: slots must be >= 1")
        if any(k < 2 or not p >= 0 for k, p in self.lockstep_s):
            raise PlanModelError(f"node {self.name!r}: lockstep penalties need k >= 2, p >= 0")

    def lockstep_at(self, k: int) -> float:
        """Seconds per sync with `k` of a group's ranks on this host: the figure measured for the
        largest k' <= k (0 for a lone rank or none measured)."""
        known = [(kk, p) for kk, p in self.lockstep_s if kk <= k]
        return max(known)[1] if known else 0.0


@dataclass(frozen=True)
class LinkSpec:
    """The network between ranks: round trip, TCP goodput, software cost per message per rank
    (device-host staging, framing, syscalls and the f32 reduction, as measured for small tensors)."""

    rtt_s: float
    goodput_bytes_per_s: float
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rtt_s < 0 or self.overhead_s < 0 or not self.goodput_bytes_per_s > 0:
            raise PlanModelError(f"invalid link {self}")

    def message_s(self, nbytes: float) -> float:
        return self.rtt_s / 2 + nbytes / self.goodput_bytes_per_s + self.overhead_s


@dataclass(frozen=True)
class Layout:
    """`tp` ranks per stage, `pp` stages; `weighted` sizes shards and stages by node speed."""

    tp: int = 1
    pp: int = 1
    weighted: bool = False

    @property
    def n_ranks(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        if self.n_ranks == 1:
            return "single"
        parts = ([f"TP={self.tp}"] if self.tp > 1 else []) + (
            [f"PP={self.pp}"] if self.pp > 1 else []
        )
        return "x".join(parts) + (" weighted" if self.weighted else "")


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    s_per_token: float
    compute_s: float  # per token, summed over stages
    sync_s: float  # per token: all-reduces, gathers, control and pipeline hops
    wire_bytes_per_token: int  # payload bytes all ranks put on the network per token
    stage_layers: tuple[int, ...]
    tp_shares: tuple[float, ...]  # stage 0's per-rank share of a layer
    lockstep_s: float = 0.0  # per token: TP ranks waiting for each other at the syncs

    @property
    def tok_per_s(self) -> float:
        return 1.0 / self.s_per_token


def allreduce_s(link: LinkSpec, n: int, nbytes: int) -> float:
    """All-reduce of `nbytes` over `n` ranks (0 for n == 1), in the algorithm the ring picks."""
    if n == 1:
        return 0.0
    if choose_all_reduce(nbytes, n, DEFAULT_SMALL_MAX_BYTES) == RANK_ORDER:
        return (n - 1) * link.message_s(nbytes)  # all-gather of whole tensors
    return 2 * (n - 1) * link.message_s(nbytes / n)  # reduce-scatter + all-gather


def allreduce_wire_bytes(n: int, nbytes: int) -> int:
    """Payload bytes all n ranks send in one all-reduce."""
    if n == 1:
        return 0
    if choose_all_reduce(nbytes, n, DEFAULT_SMALL_MAX_BYTES) == RANK_ORDER:
        return n * (n - 1) * nbytes
    return round(2 * (n - 1) * nbytes)


def layer_shares(
    config: Any,
    tp: int,
    weights: tuple[float, ...] | None,
    moe: str = "tp",
    blocks: Mapping[str, int] | None = None,
) -> tuple[float, ...]:
    """Each TP rank's fraction of the parameters one decoder layer reads per token under
    `parallel.plan`'s tiling, a mixture of experts placed by `moe` (`_ffn_read`). `blocks`: the
    file's contraction block sizes (`parallel.plan.contraction_blocks`; None for a preset or a
    dense checkpoint), so the split is the one the loader makes or refuses."""
    if tp == 1:
        return (1.0,)
    plan = plan_for_config(config, tp, weights, moe=moe, **(blocks or {}))
    d, L = config.hidden_size, config.num_hidden_layers
    total_attn = d * plan.head_dim * (plan.n_heads * 2 + plan.n_kv_heads * 2)
    total = total_attn + sum(_ffn_read(config, plan, None, i) for i in range(L)) / L
    shares = []
    for r in range(tp):
        attn = d * (2 * plan.q_rows(r).size + 2 * plan.kv_rows(r).size)
        shares.append((attn + sum(_ffn_read(config, plan, r, i) for i in range(L)) / L) / total)
    return tuple(shares)


def _ffn_read(config: Any, plan: Any, rank: int | None, layer: int) -> float:
    """Feed-forward parameters of `layer` rank `rank` reads per token (None: the whole layer's).
    A sparse layer of E experts, k active, width w, hidden D: the router E D (every rank), then

        k (h_r / E) D 3     h_r the rank's expert rows (`TPPlan.held_expert_rows`):
                            --moe tp: E w_r (its w_r rows of each chosen expert, on average
                            where the cut differs by expert); --moe experts: n_r w, its n_r
                            whole experts that the k chosen land on k n_r / E times on
                            average (routing taken as uniform)

    and its rows of the shared expert (`partition.layer_read_params` for the whole layer). Under
    whole experts the ranks' shares follow their expert counts, not their rows."""
    d, spec = config.hidden_size, getattr(config, "moe", None)
    if spec is None or not spec.is_sparse(layer):
        rows = config.intermediate_size if rank is None else plan.intermediate[rank].size
        return 3 * d * rows
    if rank is None:
        experts, rows, shared = spec.top_k, spec.intermediate_size, spec.shared_intermediate_size
    else:
        experts, rows = spec.top_k / spec.num_experts, plan.held_expert_rows(rank)
        shared = plan.shared_rows[rank].size if plan.shared_rows else 0
    gate = d if spec.shared_intermediate_size else 0
    return spec.num_experts * d + 3 * d * (experts * rows + shared) + gate


def vocab_shares(
    config: Any,
    tp: int,
    weights: tuple[float, ...] | None,
    blocks: Mapping[str, int] | None = None,
) -> tuple[float, ...]:
    if tp == 1:
        return (1.0,)
    plan = plan_for_config(config, tp, weights, **(blocks or {}))
    return tuple(s.size / config.vocab_size for s in plan.vocab)


def _by_host(nodes: list[NodeSpec]) -> dict[str, list[int]]:
    """Indices of `nodes` per machine (a node without a host is a machine of its own)."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        out.setdefault(n.host or f"#{n.name}#{i}", []).append(i)
    return out


def group_time(work: list[float], nodes: list[NodeSpec]) -> float:
    """Lockstep ranks: the slowest host, where a host's ranks share its `slots` (module docstring)."""
    return max(
        max(max(work[i] for i in ix), sum(work[i] for i in ix) / nodes[ix[0]].slots)
        for ix in _by_host(nodes).values()
    )


def lockstep_per_sync(nodes: list[NodeSpec]) -> float:
    """One TP group's waiting per sync: its slowest host's penalty at the ranks it runs."""
    if len(nodes) < 2:
        return 0.0
    return max(nodes[ix[0]].lockstep_at(len(ix)) for ix in _by_host(nodes).values())


def predict(
    config: Any,
    layout: Layout,
    nodes: list[NodeSpec],
    link: LinkSpec,
    moe: str = "tp",
    blocks: Mapping[str, int] | None = None,
) -> Prediction:
    """The predicted time per decode token of `layout` on `nodes[:tp*pp]` (stage-major order);
    `moe`: a mixture of experts' placement in each TP stage ("tp" rows or "experts" whole);
    `blocks`: the file's contraction block sizes (`layer_shares`)."""
    if layout.tp < 1 or layout.pp < 1:
        raise PlanModelError(f"invalid layout {layout}")
    if len(nodes) < layout.n_ranks:
        raise PlanModelError(f"{layout.name} needs {layout.n_ranks} nodes, {len(nodes)} given")
    cost = model_cost(config)
    read = cost.num_layers * cost.layer_params + cost.head_compute_params
    frac_layer, frac_head = cost.layer_params / read, cost.head_compute_params / read
    stages = [nodes[i * layout.tp : (i + 1) * layout.tp] for i in range(layout.pp)]
    speeds = [[1.0 / n.s_per_token for n in st] for st in stages]
    tp_weights = [tuple(sp) if layout.weighted else None for sp in speeds]
    if layout.pp == 1:
        counts = [cost.num_layers]
    else:
        caps = [StageCapacity(speed=sum(sp) if layout.weighted else 1.0) for sp in speeds]
        counts = [len(r) for r in partition_layers(caps, cost)]
    s_hidden = WIRE_BYTES_PER_ELEMENT * config.hidden_size
    compute = sync = lockstep = 0.0
    wire = 0
    for i, st in enumerate(stages):
        shares = layer_shares(config, layout.tp, tp_weights[i], moe, blocks)
        per_layer = group_time([f * n.s_per_token * frac_layer for f, n in zip(shares, st)], st)
        compute += counts[i] * per_layer
        ar = allreduce_s(link, layout.tp, s_hidden)
        sync += counts[i] * 2 * ar
        wire += counts[i] * 2 * allreduce_wire_bytes(layout.tp, s_hidden)
        if layout.tp > 1:  # every all-reduce, plus the head's embedding, control and argmax
            lockstep += (counts[i] * 2 + (3 if i == 0 else 0)) * lockstep_per_sync(st)
        if i == 0:
            vs = vocab_shares(config, layout.tp, tp_weights[0], blocks)
            compute += group_time([v * n.s_per_token * frac_head for v, n in zip(vs, st)], st)
            if layout.tp > 1:
                pairs = WIRE_BYTES_PER_ELEMENT * 2 * layout.tp  # the argmax's (max, index) pairs
                sync += ar + link.message_s(CONTROL_BYTES) + allreduce_s(link, layout.tp, pairs)
                wire += allreduce_wire_bytes(layout.tp, s_hidden)
                wire += allreduce_wire_bytes(layout.tp, pairs) + (layout.tp - 1) * CONTROL_BYTES
    if layout.pp > 1:
        sync += layout.pp * link.message_s(s_hidden)
        wire += layout.pp * layout.tp * s_hidden
    first_shares = layer_shares(config, layout.tp, tp_weights[0], moe, blocks)
    return Prediction(layout, compute + sync + lockstep, compute, sync, wire, tuple(counts),
                      tuple(first_shares), lockstep)  # fmt: skip


def candidate_layouts(n_nodes: int, max_tp: int = 8, max_pp: int = 8) -> list[Layout]:
    """Every (tp, pp) grid that fits in `n_nodes`, equal and speed-weighted (weights matter only
    when there is more than one rank)."""
    out = []
    for tp, pp in product(range(1, max_tp + 1), range(1, max_pp + 1)):
        if tp * pp > n_nodes:
            continue
        out.append(Layout(tp, pp))
        if tp * pp > 1:
            out.append(Layout(tp, pp, weighted=True))
    return out


def rank_layouts(
    config: Any,
    nodes: list[NodeSpec],
    link: LinkSpec,
    layouts: list[Layout] | None = None,
    moe: str = "tp",
    blocks: Mapping[str, int] | None = None,
) -> list[Prediction]:
    """Predictions for every feasible layout, fastest first (ties: fewer ranks, then unweighted),
    a mixture of experts placed by `moe` in every TP stage. With a file's `blocks`
    (`parallel.plan.contraction_blocks`) a layout is feasible exactly where the loader's
    `plan_for_source` plans it: the same `plan_for_config` with the same block sizes.

    Nodes are taken fastest first, so a layout of k ranks uses the k fastest nodes and the head
    (rank 0, which also runs the LM head) is the fastest."""
    if not nodes:
        raise PlanModelError("no nodes given")
    nodes = sorted(nodes, key=lambda n: n.s_per_token)
    layouts = candidate_layouts(len(nodes)) if layouts is None else layouts
    preds = []
    for lay in layouts:
        if lay.weighted and len({n.s_per_token for n in nodes[: lay.n_ranks]}) == 1:
            continue  # equal nodes: the weighted layout is the unweighted one
        try:
            preds.append(predict(config, lay, nodes, link, moe, blocks))
        except (TPPlanError, PartitionError):
            continue  # more TP ranks than kv heads, more stages than layers, an untileable split
    return sorted(
        preds, key=lambda p: (round(p.s_per_token, 9), p.layout.n_ranks, p.layout.weighted)
    )


# ---- parsing the figures a user gives on the command line ----------------------------------------

_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {  # -> bytes per second
    "gbit": 1e9 / 8, "mbit": 1e6 / 8, "gbps": 1e9 / 8, "mbps": 1e6 / 8,
    "gb/s": 1e9, "mb/s": 1e6,
}  # fmt: skip
TCP_EFFICIENCY = 0.94  # goodput / line rate we measured through tbf (295 MB/s of 312.5 at 2.5 Gbit)


def parse_duration(text: str) -> float:
    """`'6ms'` -> 0.006; `'80us'`, `'0.2s'`; also `'168tok/s'` (the inverse rate)."""
    t = text.strip().lower()
    if t.endswith("tok/s"):
        return 1.0 / _positive(t[:-5], text)
    for unit in ("us", "ms", "s"):
        if t.endswith(unit):
            return _positive(t[: -len(unit)], text) * _TIME_UNITS[unit]
    raise PlanModelError(
        f"{text!r}: expected a duration like 6ms, 80us, 0.2s or a rate like 168tok/s"
    )


def parse_rate(text: str) -> float:
    """A link's goodput in bytes/s: `'280MB/s'` as is; a line rate (`'2.5gbit'`) times
    `TCP_EFFICIENCY`."""
    t = text.strip().lower()
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            value = _positive(t[: -len(unit)], text) * _RATE_UNITS[unit]
            return value if unit.endswith("/s") else value * TCP_EFFICIENCY
    raise PlanModelError(f"{text!r}: expected a rate like 2.5gbit, 1000mbit or 280MB/s")


def parse_node(text: str) -> NodeSpec:
    """`NAME:TIME[@HOST]`, e.g. `gpu:6ms`, `spark:168tok/s`, `cpu0:400ms@box`."""
    spec, _, host = text.partition("@")
    name, sep, when = spec.partition(":")
    if not sep or not name:
        raise PlanModelError(f"--node {text!r}: expected NAME:TIME[@HOST], e.g. gpu:6ms")
    return NodeSpec(name=name, s_per_token=parse_duration(when), host=host)


def parse_lockstep(text: str) -> tuple[str, tuple[tuple[int, float], ...]]:
    """`HOST:K=TIME[,K=TIME...]`, e.g. `box:2=0.3ms,3=0.8ms` -> ("box", ((2, 3e-4), (3, 8e-4))):
    a host's lockstep penalty per sync with K of a group's ranks on it (`tandem bench` measures
    it; `lockstep.py`)."""
    host, sep, pairs = text.partition(":")
    if not sep or not host or not pairs:
        raise PlanModelError(
            f"--lockstep {text!r}: expected HOST:K=TIME[,K=TIME], e.g. box:2=0.3ms"
        )
    out = {}
    for pair in pairs.split(","):
        k, eq, when = pair.strip().partition("=")
        if not eq or not k.strip().isdigit() or int(k) < 2:
            raise PlanModelError(f"--lockstep {text!r}: {pair!r} is not K=TIME with K >= 2")
        t = when.strip().lower()
        out[int(k)] = 0.0 if t in ("0", "0s", "0ms", "0us") else parse_duration(t)
    return host, tuple(sorted(out.items()))


def _positive(number: str, text: str) -> float:
    try:
        value = float(number)
    except ValueError:
        raise PlanModelError(f"{text!r}: {number!r} is not a number") from None
    if not value > 0:
        raise PlanModelError(f"{text!r}: must be > 0")
    return value
