"""The speed model's inputs from a live cluster's probes (`tandem plan --from-cluster TOKEN` or
`--from-status FILE`, the JSON of `tandem cluster status --json`).

Each rank that formed a group measured itself at join (`engine.tp.probe`): its decode GEMV speed
(weight bytes per second through its own kernel in its own dtype), its free memory, and the group's
one-float all-reduce time and goodput. A rank becomes a `NodeSpec` whose time per token alone on
the whole model is the model's weight bytes in its dtype over its GEMV speed,

    s_per_token(r) = (L c + h) e_r / gemv_bytes_per_s(r)     (`partition.model_cost`: c, h)

and the group's figures become the link: rtt = the one-float all-reduce (a round over the ring),
goodput = the probe's. The probes were measured with every rank running at once, as a group runs,
so ranks that share a machine already show what sharing costs them; each rank is its own host here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.parallel.partition import model_cost
from tandem.plan.model import LinkSpec, NodeSpec, PlanModelError

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROBE_FIELDS = ("gemv_gb_s", "free_gb", "allreduce_ms", "goodput_mbit_s")


def probe_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranks of a `cluster status --json` snapshot that carry a probe, by rank; a snapshot
    without any (no group has formed yet) is a `PlanModelError`."""
    ranks = snapshot.get("ranks") if isinstance(snapshot, dict) else None
    if not isinstance(ranks, list):
        raise PlanModelError("not a cluster status snapshot: no 'ranks' list")
    rows = []
    for row in ranks:
        probe = row.get("probe") if isinstance(row, dict) else None
        if not isinstance(probe, dict):
            continue
        if not all(isinstance(probe.get(k), int | float) for k in PROBE_FIELDS):
            raise PlanModelError(f"rank {row.get('rank')}: probe lacks one of {PROBE_FIELDS}")
        rows.append(row)
    if not rows:
        raise PlanModelError(
            "no rank has a probe yet: the probe runs when the group forms (join with --model)"
        )
    return sorted(rows, key=lambda r: int(r["rank"]))


def load_snapshot(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanModelError(f"{path}: {e}") from None


def nodes_from_probes(config: Any, rows: list[dict[str, Any]]) -> list[NodeSpec]:
    """One node per probed rank (module docstring), named by rank, device and dtype."""
    cost = model_cost(config)
    params = cost.num_layers * cost.layer_params + cost.head_compute_params
    nodes = []
    for row in rows:
        dtype = str(row.get("dtype", "float32"))
        if dtype not in ELEMENT_BYTES:
            raise PlanModelError(f"rank {row['rank']}: unknown dtype {dtype!r}")
        speed = float(row["probe"]["gemv_gb_s"]) * 1e9
        if not speed > 0:
            raise PlanModelError(f"rank {row['rank']}: GEMV speed must be > 0")
        name = f"rank{row['rank']} {row.get('device', '?')} {dtype}"
        nodes.append(NodeSpec(name, params * ELEMENT_BYTES[dtype] / speed))
    return nodes


def link_from_probes(rows: list[dict[str, Any]], overhead_s: float) -> LinkSpec:
    """The group's link: its slowest all-reduce round and its lowest goodput among the rows."""
    rtt_ms = max(float(r["probe"]["allreduce_ms"]) for r in rows)
    goodput = min(float(r["probe"]["goodput_mbit_s"]) for r in rows)
    if not goodput > 0:
        raise PlanModelError("the probes' goodput must be > 0")
    return LinkSpec(
        rtt_s=rtt_ms / 1e3, goodput_bytes_per_s=goodput * 1e6 / 8, overhead_s=overhead_s
    )


def render_probes(rows: list[dict[str, Any]]) -> str:
    """One line per rank: what placement reads from its probe."""
    return "\n".join(
        f"rank {r['rank']} ({r.get('device', '?')} {r.get('dtype', '?')}): "
        f"GEMV {r['probe']['gemv_gb_s']:.2f} GB/s, {r['probe']['free_gb']:.2f} GB free; "
        f"group all-reduce {r['probe']['allreduce_ms']:.3f} ms, "
        f"{r['probe']['goodput_mbit_s']:.0f} Mbit/s"
        for r in rows
    )
