"""What one rank of a mixture-of-experts model holds and reads per decode token, in bytes as its
weights are stored (the file's block types: a Q4_K expert costs 144 / 256 bytes an element, a
bfloat16 one 2): `rank_reads`, shown by `tandem plan` and `/v1/cluster`.

A rank holding decoder layers `[a, b)` of a model of hidden size D under a `TPPlan` (one rank,
every expert, for a single node or a pipeline stage without TP) reads per token, per layer, with
`b(t)` the bytes per element of tensor t:

    attention     D (q_r b(q) + kv_r (b(k) + b(v)) + o_r b(o))    q_r, kv_r: its q / kv rows
                                                                  (gated attention: 2 hd a
                                                                  head); o_r: o_proj columns
    DeltaNet      D (c_r b(qkv) + z_r b(z) + v_r (b(a) + b(b))    c_r: its in_proj_qkv rows,
                     + z_r b(out))                                z_r = v_r dv: its v heads'
                                                                  z rows and out_proj columns
    sparse layer  router  E D b(gate)                             every rank routes the full token
                  experts k (n_r / E) w_r D (b(gate_e) + b(up_e) + b(down_e))
                  shared  s_r D (b(sg) + b(su) + b(sd)) + D b(shared_expert_gate)
    dense layer   F_r D (b(g) + b(u) + b(d))                      its MLP rows F_r

with E experts, k active per token, s_r rows of the shared expert, and the rank's expert rows
per sparse layer h_r = sum over its groups g (`plan.expert_groups[r]`: experts [f_g, l_g), rows
[a_g, b_g) of each) of (l_g - f_g)(b_g - a_g), written n_r w_r: under `--moe experts` its n_r
whole experts of w_r = w rows; under `--moe tp` every expert (n_r = E) at w_r = h_r / E rows on
average (exactly its rows of each where the width divides evenly; `parallel.expert_split`
otherwise). A token's k experts land on its groups in proportion to their experts (routing taken
as uniform over experts; a real router's preferences move it), so it reads k h_r / E expert rows:
exactly k w_r under an even `tp` cut, an expectation otherwise. It holds every one of its
experts: `held_expert_bytes` = sum over sparse layers of h_r D (b(gate_e) + b(up_e) + b(down_e)).
Norms, biases, attention sinks, the embedding and the LM head are left out (the LM head is in
`work_share`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.parallel.plan import TPPlan

ElementBytes = Callable[[str], float]  # tensor name -> bytes per element as stored

EXPERT_PROJ = ("gate", "up", "down")


def uniform_bytes(nbytes: float) -> ElementBytes:
    """Every tensor at `nbytes` per element (a preset, which has no file: bfloat16 is 2)."""
    return lambda name: nbytes


def source_bytes(source: Any) -> ElementBytes:
    """Bytes per element of each tensor of a model source as stored: a block type's row bytes
    over its columns (GGUF, --quantize, MXFP4), a safetensors dtype's size otherwise."""
    from tandem.models.quant.blocks import BY_ID

    def per_element(name: str) -> float:
        info = source.info(name)
        layout = BY_ID.get(getattr(info, "type_id", -1))
        cols = info.shape[-1]
        if layout is not None and layout.block_size > 1:
            return layout.row_bytes(cols) / cols
        return info.nbytes / math.prod(info.shape)

    return per_element


def whole_model_entry(source: Any) -> dict[str, Any] | None:
    """`RankReads.entry()` of one rank holding every layer and expert of `source` (a single
    node); None for a dense model."""
    from tandem.parallel.plan import plan_for_config

    config = source.config
    layers = (0, config.num_hidden_layers)
    reads = rank_reads(config, plan_for_config(config, 1), 0, layers, source_bytes(source))
    return None if reads is None else reads.entry()


@dataclass(frozen=True)
class RankReads:
    """One rank's placement of the experts and its bytes per token (module docstring)."""

    moe: str  # "tp" (rows of every expert) or "experts" (whole experts)
    experts: tuple[int, int]  # held (whole or in part), first to last, half-open
    n_experts: int  # how many of them it holds
    groups: tuple[tuple[tuple[int, int], tuple[int, int]], ...]  # (experts, rows of each)
    row_share: float  # w_r / w: rows held over the held experts' rows
    active_experts: float  # experts a token reads here per sparse layer: k h_r / (E w)
    attention_bytes: float
    router_bytes: float
    expert_bytes: float  # expected, per token
    shared_bytes: float
    dense_mlp_bytes: float
    held_expert_bytes: float

    @property
    def active_bytes(self) -> float:
        return (
            self.attention_bytes
            + self.router_bytes
            + self.expert_bytes
            + self.shared_bytes
            + self.dense_mlp_bytes
        )

    def entry(self) -> dict[str, Any]:
        return {
            "moe": self.moe,
            "experts": list(self.experts),
            "n_experts": self.n_experts,
            "expert_groups": [{"experts": list(e), "rows": list(r)} for e, r in self.groups],
            "row_share": self.row_share,
            "active_experts": self.active_experts,
            "active_bytes_per_token": round(self.active_bytes),
            "active_bytes": {
                "attention": round(self.attention_bytes),
                "router": round(self.router_bytes),
                "experts": round(self.expert_bytes),
                "shared_expert": round(self.shared_bytes),
                "dense_mlp": round(self.dense_mlp_bytes),
            },
            "held_expert_bytes": round(self.held_expert_bytes),
        }


def rank_reads(
    config: Any, plan: TPPlan, rank: int, layers: tuple[int, int], nbytes: ElementBytes
) -> RankReads | None:
    """Rank `rank` of `plan` holding decoder layers `layers`: what it holds and reads per token
    (module docstring); None for a dense model."""
    spec = getattr(config, "moe", None)
    if spec is None:
        return None
    D, E, w = config.hidden_size, spec.num_experts, spec.intermediate_size
    ex, groups = plan.held_experts(rank), plan.expert_groups[rank]
    q, kv, o = plan.q_proj_rows(rank).size, plan.kv_rows(rank).size, plan.o_columns(rank).size
    held_share = plan.held_expert_rows(rank)  # h_r = n_r w_r: expert rows held per sparse layer
    active = spec.top_k * held_share / E  # k h_r / E
    shared = plan.shared_rows[rank].size if plan.shared_rows else 0
    attn = router = experts = held = shared_b = dense = 0.0
    for i in range(*layers):
        p = f"model.layers.{i}."
        if config.is_linear(i):
            attn += D * _deltanet_rows(plan, rank, p + "linear_attn.", nbytes)
        elif plan.holds_attention(rank):
            attn += D * (
                q * nbytes(p + "self_attn.q_proj.weight")
                + kv * (nbytes(p + "self_attn.k_proj.weight") + nbytes(p + "self_attn.v_proj.weight"))
                + o * nbytes(p + "self_attn.o_proj.weight")
            )  # fmt: skip
        if not spec.is_sparse(i):
            mlp = sum(nbytes(f"{p}mlp.{n}_proj.weight") for n in EXPERT_PROJ)
            dense += plan.intermediate[rank].size * D * mlp
            continue
        per_row = D * sum(nbytes(f"{p}mlp.experts.{n}_proj.weight") for n in EXPERT_PROJ)
        router += E * D * nbytes(p + "mlp.gate.weight")
        experts += active * per_row
        held += held_share * per_row
        if spec.shared_intermediate_size:
            s = f"{p}mlp.shared_expert."
            shared_b += shared * D * sum(nbytes(f"{s}{n}_proj.weight") for n in EXPERT_PROJ)
            shared_b += D * nbytes(p + "mlp.shared_expert_gate.weight")
    return RankReads(
        moe=plan.moe,
        experts=(ex.start, ex.end),
        n_experts=plan.n_held_experts(rank),
        groups=tuple(
            ((g.experts.start, g.experts.end), (g.rows.start, g.rows.end)) for g in groups
        ),
        row_share=held_share / (plan.n_held_experts(rank) * w),
        active_experts=active / w,
        attention_bytes=attn,
        router_bytes=router,
        expert_bytes=experts,
        shared_bytes=shared_b,
        dense_mlp_bytes=dense,
        held_expert_bytes=held,
    )


def _deltanet_rows(plan: TPPlan, rank: int, p: str, nbytes: ElementBytes) -> float:
    """A Gated DeltaNet layer's bytes per element of D that `rank` reads (module docstring):
    its in_proj_qkv rows, in_proj_z / out_proj rows / columns and in_proj_a / in_proj_b rows."""
    v = plan.linear_v_heads(rank).size
    z = v * plan.linear_dims[3]
    return (
        sum(r.size for r in plan.linear_qkv_rows(rank)) * nbytes(p + "in_proj_qkv.weight")
        + z * (nbytes(p + "in_proj_z.weight") + nbytes(p + "out_proj.weight"))
        + v * (nbytes(p + "in_proj_a.weight") + nbytes(p + "in_proj_b.weight"))
    )
