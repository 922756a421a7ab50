"""The picked layout's expert placement for `tandem plan`: each rank's experts, its rows of each,
the bytes it reads per token and the expert bytes it holds (`parallel.moe_reads`).

Ranks are taken as `model.rank_layouts` takes them: nodes fastest first, stage-major (stage i's
TP ranks are nodes `[i tp, (i + 1) tp)`), stage i holding `stage_layers[i]` consecutive layers; a
weighted layout splits each stage's experts (or rows) by its nodes' speeds, 1 / s_per_token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.parallel.moe_reads import ElementBytes, RankReads, rank_reads
from tandem.parallel.plan import plan_for_config
from tandem.plan.model import Layout, NodeSpec


@dataclass(frozen=True)
class PlacedRank:
    rank: int  # global, stage-major
    node: str
    stage: int
    tp_rank: int
    layers: tuple[int, int]
    reads: RankReads

    def entry(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "stage": self.stage,
                "tp_rank": self.tp_rank, "layers": list(self.layers), **self.reads.entry()}  # fmt: skip


@dataclass(frozen=True)
class Placement:
    moe: str
    ranks: tuple[PlacedRank, ...]

    def entry(self) -> dict[str, Any]:
        return {"moe": self.moe, "ranks": [r.entry() for r in self.ranks]}


def place_experts(
    config: Any,
    layout: Layout,
    stage_layers: tuple[int, ...],
    nodes: list[NodeSpec],
    moe: str,
    nbytes: ElementBytes,
    blocks: dict[str, int] | None = None,
) -> Placement | None:
    """The placement of `layout` on `nodes` (module docstring); None for a dense model. `blocks`:
    the file's contraction block sizes (`parallel.plan.contraction_blocks`)."""
    if getattr(config, "moe", None) is None:
        return None
    nodes = sorted(nodes, key=lambda n: n.s_per_token)
    out, start = [], 0
    for k, count in enumerate(stage_layers):
        stage = nodes[k * layout.tp : (k + 1) * layout.tp]
        weights = tuple(1.0 / n.s_per_token for n in stage) if layout.weighted else None
        plan = plan_for_config(config, layout.tp, weights, moe=moe, **(blocks or {}))
        layers = (start, start + count)
        for r, node in enumerate(stage):
            reads = rank_reads(config, plan, r, layers, nbytes)
            assert reads is not None  # config.moe is set
            out.append(PlacedRank(k * layout.tp + r, node.name, k, r, layers, reads))
        start += count
    return Placement(moe, tuple(out))


def render_placement(config: Any, placement: Placement, bytes_note: str) -> str:
    """`tandem plan`'s lines: the experts, then one line per rank."""
    spec = config.moe
    how = {"tp": "rows of every expert", "experts": "whole experts"}
    placed = how[placement.ranks[0].reads.moe]
    if all(p.tp_rank == 0 for p in placement.ranks):  # one node, or stages of one rank each
        placed = "whole layers (every expert on each rank)"
    lines = [
        f"experts: {spec.num_experts}, {spec.top_k} active per token; placed as {placed} "
        f"(bytes {bytes_note})"
    ]
    staged = len({p.stage for p in placement.ranks}) > 1
    for p in placement.ranks:
        r = p.reads
        held = ", ".join(f"[{e[0]}, {e[1]}) rows [{w[0]}, {w[1]})" for e, w in r.groups)
        stage = f"stage {p.stage} layers [{p.layers[0]}, {p.layers[1]}) " if staged else ""
        lines.append(
            f"  rank {p.rank} ({p.node}): {stage}experts {held} ({r.n_experts} experts, "
            f"{100 * r.row_share:.0f} % of their rows); holds {r.held_expert_bytes / 1e6:.1f} MB "
            "of experts"
        )
        lines.append(
            f"    reads {r.active_bytes / 1e6:.2f} MB/token: experts {r.expert_bytes / 1e6:.2f} "
            f"({r.active_experts:.2f} experts' worth), attention {r.attention_bytes / 1e6:.2f}, "
            f"router {r.router_bytes / 1e6:.2f}, shared expert {r.shared_bytes / 1e6:.2f}, "
            f"dense MLP {r.dense_mlp_bytes / 1e6:.2f}"
        )
    return "\n".join(lines)
