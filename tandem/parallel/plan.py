"""Tensor-parallel planning: which slice of each partitioned dimension every rank owns.

Pure functions, no torch. A shard is a `Span`, the half-open range `[start, end)` of one dimension
(`shards[r]` is rank r's). A plan tiles a dimension of size `total` into `world_size` shards that are contiguous, non-overlapping and
complete (`shards[0].start == 0`, `shards[r].end == shards[r + 1].start`, `shards[-1].end == total`),
in units of an alignment block, sized in proportion to per-rank weights:

    units  = total / align
    quota_r = units * w_r / sum(w)
    size_r  = floor(quota_r) + (1 if r is among the (units - sum floor) largest remainders)

(largest-remainder apportionment, `apportion.py`; ties go to the lower rank). Any rank left with no units makes the
plan degenerate, which fails closed with `DegeneratePlanError`.

The partitioned dimensions of a Llama-family model:
  - attention: kv heads. Rank r owns kv heads `[a, b)` and, with `g = n_heads / n_kv_heads` query
    heads per kv head, query heads `[a g, b g)`: a kv head travels with its query heads, so attention
    needs no communication until the output projection.
    With more ranks than kv heads (N > n_kv_heads) kv heads are replicated instead: the ranks are
    dealt to the kv groups in contiguous blocks (as evenly as possible, lower groups first), each
    group's g query heads are split among its ranks by their weights, and each of those ranks holds
    the group's one kv head. A group with more ranks than query heads is degenerate.
  - MLP: intermediate rows, in blocks of `mlp_align` (the largest of 64, 32, ..., 1 that divides the
    intermediate size and leaves at least one block per rank).
  - vocabulary: embedding rows and LM-head rows, in blocks of `vocab_align` chosen the same way.

Block-quantized weights (GGUF) constrain only the row-parallel layers, whose contraction is split:
a column-parallel split (q/k/v, gate/up, embedding, LM head) cuts output rows, and every row is
whole blocks, so any row split keeps whole blocks. A row-parallel shard edge must fall on a block
boundary of that tensor's type (`down_block`, `o_block`: 32 elements, or 256 for the K-quants):
  - down_proj: `mlp_align = lcm(choose_align(I, N), down_block)`.
  - o_proj: its contraction edges are query-head boundaries `q.start * head_dim`. When every edge
    is a multiple of `o_block`, `o_split = "heads"` (o_proj columns = the rank's q rows). When one
    is not (SmolLM2's 9 heads of 64 at TP=2 with a K-quant o_proj: 384 % 256 != 0), the plan
    falls back to `o_split = "gather"`: the attention output (B, T, H hd) is all-gathered and
    rank r contracts o_proj's columns `o_cols[r]`, a weighted split of `[0, H hd)` in blocks of
    `o_block`, followed by the usual all-reduce. Same math; only the summation order differs.

Mixture-of-experts layers (`config.moe`) are placed one of two ways (`moe`); either way rank r
holds `expert_groups[r]`, a tuple of `ExpertGroup`s (experts `[f, l)`, rows `[a, b)` of each):
  - "tp" (the default): every expert's gate/up rows and the matching columns of its down
    projection are cut over the ranks in blocks of `expert_align` (as the MLP: the largest of
    64, 32, ... dividing the expert width w, lcm'd with the down_exps block size), u = w / align
    blocks an expert. The blocks are dealt so that each rank's total over all E experts follows
    its weight, `apportion(E u, weights)`, within one block (`expert_split`): where u divides
    evenly every expert is cut alike (one group per rank); where it does not, consecutive experts
    are cut differently, at most N groups of uniform width. Qwen3-30B-A3B's width 768 in K-quant
    superblocks of 256 is u = 3: at TP=2 experts [0, E/2) give rank 0 rows [0, 512) and rank 1
    [512, 768), experts [E/2, E) give rank 0 [0, 256) and rank 1 [256, 768): 3E/2 blocks each.
    At TP=4 each expert goes to 3 of the 4 ranks, one block each, 3E/4 blocks a rank. Each rank
    routes the full token, applies its rows of the chosen experts, and one all-reduce sums them.
  - "experts": rank r holds whole experts `[f_r, l_r)` (one group, rows `[0, w)`), their count
    apportioned by the ranks' weights (the measured speeds) over the E experts; every rank
    routes, computes only its experts' contributions, and one all-reduce sums them.
A shared expert is row-split as a dense MLP under both (`shared_rows`).
Attention stays split by kv heads either way.

A hybrid (Qwen3.5) also splits its Gated DeltaNet layers by heads: rank r owns q/k heads
`linear_k_heads[r] = [a, b)` (by its weight, a head a unit) and the v heads `[a r, b r)` they serve
(r = Hv / Hk). Its rows of in_proj_qkv (and conv channels) are three ranges, q `[a dk, b dk)`,
k `Hk dk + [a dk, b dk)`, v `2 Hk dk + [a r dv, b r dv)` (`linear_qkv_rows`); of in_proj_z
`[a r dv, b r dv)`, of in_proj_a/b, A_log and dt_bias `[a r, b r)`; out_proj's columns
`[a r dv, b r dv)`, followed by one all-reduce. The conv, the delta rule and the gated norm act
per channel or per head, so each rank's state (its channels' conv window, its v heads' matrices)
stays local.

A `qwen35` GGUF stores the v heads tiled (`linear_v_tiled`): place t Hk + g holds group g's v head
t (t < r), served by q/k head g. Rank r's v heads, the same ones [a r, b r) in HF's numbering,
are then r runs of the file, `[t Hk + a, t Hk + b)` for t = 0..r-1 (`linear_v_spans`), read in
that order: its shard is itself tiled over its own b - a q/k heads (its local v head
t (b - a) + (g - a) is served by its local q/k head g - a = that index mod (b - a)), which is the
order the model reads a tiled file in. So in_proj_qkv / conv1d take q, k and r runs of v rows
(`2 Hk dk + [(t Hk + a) dv, (t Hk + b) dv)`), in_proj_z and out_proj's columns the same runs
times dv, in_proj_a / in_proj_b / A / dt the runs themselves (`DeltaNetSpec.v_tiled`). Gated attention's q_proj rows are `2 hd` per query head (`q_proj_rows`).

Block-quantized DeltaNet weights (a Q8_0 / Q4_K_M file) are cut like the dense ones: the
in_proj_* cuts are rows, whole blocks whatever the rows. out_proj's cut is its contraction, so
every run edge must fall on a block boundary of its type (`linear_out_block` = B elements). A run
edge is `(t Hk + a) dv` (tiled) or `a r dv` (grouped), for every rank edge a; so the q/k heads are
split in units of `u` heads, the least u with `u r' dv ≡ 0 (mod B)` (r' = 1 tiled, r grouped):
`u = B / gcd(B, r' dv)` (`linear_align`), and Hk must be a multiple of u (then `Hk dv` is too, and
every run edge is whole blocks). Real files: dv = 128 in Q8_0 (B = 32) gives u = 1; in a K-quant
(B = 256) u = 2. Where Hk is not a multiple of u at more than one rank the plan is
`DegeneratePlanError`, by name.

Attention and the MLP may have different degrees (the fak design's AttnRanks / FFNRanks): with
`attn_ranks = A < N`, the kv heads are split over ranks `[0, A)` only (by their weights), and ranks
`[A, N)` hold no attention at all (empty head spans at the end, no q/k/v/o weights, no KV cache);
the MLP rows and the vocabulary still span all N ranks. o_proj's all-reduce then sums A partials
and N - A zeros (x + 0 = x exactly), so the math is the A-rank attention's. A node with little
memory or a slow link to the others can thus hold only MLP rows. Needs the `heads` o_proj split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tandem.parallel.apportion import Span, apportion, spans
from tandem.parallel.expert_split import ExpertGroup, deal_expert_rows

DEFAULT_ALIGN = 64


class TPPlanError(ValueError):
    """A tensor-parallel plan cannot be made from these inputs."""


class WeightsParseError(TPPlanError):
    """`--tp-weights` is not a comma list of positive numbers, one per rank."""


class DegeneratePlanError(TPPlanError):
    """Some rank would own nothing of a partitioned dimension (or the dimension cannot be tiled)."""


def parse_weights(text: str | None, world_size: int) -> tuple[float, ...]:
    """`"2,1"` -> `(2.0, 1.0)`; `None` or `""` -> equal weights. Fails closed on anything else."""
    if world_size < 1:
        raise TPPlanError(f"world size must be >= 1, got {world_size}")
    if text is None or text.strip() == "":
        return (1.0,) * world_size
    parts = [p.strip() for p in text.split(",")]
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        raise WeightsParseError(
            f"--tp-weights {text!r}: expected comma-separated positive numbers, e.g. '2,1'"
        ) from None
    if len(weights) != world_size:
        raise WeightsParseError(
            f"--tp-weights {text!r} gives {len(weights)} weights for {world_size} ranks"
        )
    for w in weights:
        if not math.isfinite(w) or w <= 0:
            raise WeightsParseError(f"--tp-weights {text!r}: every weight must be finite and > 0")
    return weights


def split_by_weights(
    total: int, weights: tuple[float, ...], align: int = 1, what: str = "dimension"
) -> tuple[Span, ...]:
    """Tiles `[0, total)` into one contiguous shard per weight (rank), each a multiple of `align`."""
    if not weights:
        raise TPPlanError("no ranks to split over")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise WeightsParseError(f"weights must be finite and > 0, got {weights}")
    if align < 1 or total < 1 or total % align != 0:
        raise DegeneratePlanError(f"{what} of size {total} cannot be tiled in blocks of {align}")
    units = total // align
    sizes = apportion(units, weights)
    empty = [r for r, s in enumerate(sizes) if s == 0]
    if empty:
        raise DegeneratePlanError(
            f"{what} of size {total} ({units} blocks of {align}) leaves rank(s) {empty} with no "
            f"work at weights {weights}; use fewer ranks or less skewed weights"
        )
    return spans(sizes, align)


def choose_align(total: int, world_size: int, preferred: int = DEFAULT_ALIGN) -> int:
    """The largest of `preferred, preferred/2, ..., 1` dividing `total` with `total/align >= N`."""
    align = preferred
    while align > 1:
        if total % align == 0 and total // align >= world_size:
            return align
        align //= 2
    return 1


@dataclass(frozen=True)
class TPPlan:
    """Every rank's share of the kv heads, MLP intermediate rows and vocabulary (all half-open)."""

    world_size: int
    weights: tuple[float, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    kv_heads: tuple[Span, ...]  # may overlap (replicated kv heads) when N > n_kv_heads
    q_head_shards: tuple[Span, ...]
    intermediate: tuple[Span, ...]
    vocab: tuple[Span, ...]
    mlp_align: int
    vocab_align: int
    o_split: str = "heads"  # "heads" or "gather" (module docstring)
    o_cols: tuple[Span, ...] = ()  # o_proj contraction columns per rank
    o_block: int = 1
    down_block: int = 1
    attn_ranks: int = 0  # ranks [0, attn_ranks) hold attention; 0 means every rank
    moe: str = "tp"  # "tp" or "experts" (module docstring); "tp" for a dense model
    expert_groups: tuple[tuple[ExpertGroup, ...], ...] = ()  # per rank; () for a dense model
    shared_rows: tuple[Span, ...] = ()  # rows of the shared expert per rank
    expert_align: int = 1
    q_gate: bool = False  # q_proj holds per head hd query rows then hd gate rows (Qwen3.5)
    # Gated DeltaNet layers (Qwen3.5): each rank's q/k heads, and (Hk, Hv, dk, dv)
    linear_k_heads: tuple[Span, ...] = ()
    linear_dims: tuple[int, int, int, int] = (0, 0, 0, 0)
    linear_v_tiled: bool = False  # v heads stored tiled (a qwen35 GGUF; module docstring)
    linear_align: int = 1  # q/k heads per unit: out_proj's runs on its blocks (module docstring)

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def attention_ranks(self) -> int:
        """A: how many ranks (the first A) hold attention heads."""
        return self.attn_ranks or self.world_size

    def held_expert_rows(self, rank: int) -> int:
        """Expert rows `rank` holds per sparse layer: sum over its groups of n_g (b_g - a_g)."""
        return sum(g.expert_rows for g in self.expert_groups[rank])

    def held_experts(self, rank: int) -> Span:
        """The experts `rank` holds (whole or in part), its first group's first to its last
        group's last; between them a gap where it holds none (4 ranks on 3 blocks)."""
        groups = self.expert_groups[rank]
        return Span(groups[0].experts.start, groups[-1].experts.end)

    def n_held_experts(self, rank: int) -> int:
        """How many experts `rank` holds (whole or in part): its groups share none."""
        return sum(g.experts.size for g in self.expert_groups[rank])

    def holds_attention(self, rank: int) -> bool:
        return rank < self.attention_ranks

    @property
    def replicates_kv(self) -> bool:
        return self.attention_ranks > self.n_kv_heads

    def q_heads(self, rank: int) -> Span:
        """Query heads of `rank`: `[a g, b g)` for kv heads `[a, b)`, or part of one kv group."""
        return self.q_head_shards[rank]

    def q_rows(self, rank: int) -> Span:
        """Rows of `q_proj.weight` (and columns of `o_proj.weight`) owned by `rank`."""
        q = self.q_heads(rank)
        return Span(q.start * self.head_dim, q.end * self.head_dim)

    def o_columns(self, rank: int) -> Span:
        """Columns of `o_proj.weight` owned by `rank` (its q rows unless `o_split == "gather"`)."""
        return self.o_cols[rank] if self.o_cols else self.q_rows(rank)

    def kv_rows(self, rank: int) -> Span:
        """Rows of `k_proj.weight` and `v_proj.weight` owned by `rank`."""
        kv = self.kv_heads[rank]
        return Span(kv.start * self.head_dim, kv.end * self.head_dim)

    def q_proj_rows(self, rank: int) -> Span:
        """Rows of `q_proj.weight` owned by `rank`: its q rows, or with `q_gate` each of its
        heads' 2 hd query-and-gate rows."""
        if not self.q_gate:
            return self.q_rows(rank)
        q = self.q_heads(rank)
        return Span(2 * q.start * self.head_dim, 2 * q.end * self.head_dim)

    def linear_v_heads(self, rank: int) -> Span:
        """A DeltaNet layer's v heads of `rank`: `[a r, b r)` for q/k heads `[a, b)`, r = Hv / Hk
        (a q/k head travels with the v heads it serves)."""
        k = self.linear_k_heads[rank]
        rep = self.linear_dims[1] // self.linear_dims[0]
        return Span(k.start * rep, k.end * rep)

    def linear_v_spans(self, rank: int) -> tuple[Span, ...]:
        """`rank`'s v heads as places in the stored order, in the order its shard holds them:
        `[a r, b r)` where the heads are grouped; r runs `[t Hk + a, t Hk + b)` where tiled
        (module docstring)."""
        if not self.linear_v_tiled:
            return (self.linear_v_heads(rank),)
        k, (Hk, Hv) = self.linear_k_heads[rank], self.linear_dims[:2]
        return tuple(Span(t * Hk + k.start, t * Hk + k.end) for t in range(Hv // Hk))

    def linear_qkv_rows(self, rank: int) -> tuple[Span, ...]:
        """Rows of `in_proj_qkv.weight` (and channels of `conv1d.weight`) owned by `rank`: its
        q rows in [0, Hk dk), its k rows in [Hk dk, 2 Hk dk), its v rows after them (one run,
        or r where the v heads are tiled: `linear_v_spans`)."""
        Hk, _, dk, dv = self.linear_dims
        k = self.linear_k_heads[rank]
        return (
            Span(k.start * dk, k.end * dk),
            Span(Hk * dk + k.start * dk, Hk * dk + k.end * dk),
            *(
                Span(2 * Hk * dk + v.start * dv, 2 * Hk * dk + v.end * dv)
                for v in self.linear_v_spans(rank)
            ),
        )


def make_tp_plan(
    *,
    world_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    weights: tuple[float, ...] | None = None,
    o_block: int = 1,
    down_block: int = 1,
    attn_ranks: int | None = None,
    n_experts: int = 0,
    expert_width: int = 0,
    shared_width: int = 0,
    experts_down_block: int = 1,
    moe: str = "tp",
) -> TPPlan:
    """The plan for `world_size` ranks; equal weights unless `weights` is given (one per rank).
    `o_block` / `down_block`: the block size (elements) of o_proj's / down_proj's contraction
    (1 for dense weights). `attn_ranks`: attention on the first A ranks only (module docstring;
    None: every rank). `n_experts` > 0: a mixture of experts of `expert_width` rows each (and a
    shared expert of `shared_width`), placed by `moe` ("tp" or "experts")."""
    if world_size < 1:
        raise TPPlanError(f"world size must be >= 1, got {world_size}")
    weights = (1.0,) * world_size if weights is None else tuple(float(w) for w in weights)
    if len(weights) != world_size:
        raise WeightsParseError(f"{len(weights)} weights for {world_size} ranks")
    if n_kv_heads < 1 or n_heads % n_kv_heads != 0:
        raise TPPlanError(f"{n_heads} query heads are not a multiple of {n_kv_heads} kv heads")
    a = world_size if attn_ranks is None else attn_ranks
    if not 1 <= a <= world_size:
        raise TPPlanError(f"attention on {a} ranks: choose 1 to {world_size} (the group's size)")
    if a > n_heads:
        raise DegeneratePlanError(
            f"attention over {a} ranks exceeds the model's {n_heads} attention heads: every "
            f"attention rank needs at least one, so use at most {n_heads}"
        )
    kv_heads, q_heads = _split_attention(a, n_heads, n_kv_heads, weights[:a])
    kv_heads += (Span(n_kv_heads, n_kv_heads),) * (world_size - a)  # no attention: empty spans
    q_heads += (Span(n_heads, n_heads),) * (world_size - a)
    mlp_align = math.lcm(choose_align(intermediate_size, world_size), down_block)
    vocab_align = choose_align(vocab_size, world_size)
    q_cols = tuple(Span(s.start * head_dim, s.end * head_dim) for s in q_heads)
    o_split, o_cols = "heads", q_cols
    if any(s.start % o_block for s in q_cols):
        if a < world_size:
            raise TPPlanError(
                f"attention on {a} of {world_size} ranks needs o_proj split on query-head "
                f"boundaries, and its {o_block}-element blocks do not fall on them"
            )
        o_split = "gather"
        o_cols = split_by_weights(n_heads * head_dim, weights, o_block, "o_proj contraction")
    moe_fields = _place_experts(
        world_size, weights, n_experts, expert_width, shared_width, experts_down_block, moe
    )
    return TPPlan(
        world_size=world_size,
        weights=weights,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        kv_heads=kv_heads,
        q_head_shards=q_heads,
        intermediate=split_by_weights(intermediate_size, weights, mlp_align, "MLP intermediate"),
        vocab=split_by_weights(vocab_size, weights, vocab_align, "vocabulary"),
        mlp_align=mlp_align,
        vocab_align=vocab_align,
        o_split=o_split,
        o_cols=o_cols,
        o_block=o_block,
        down_block=down_block,
        attn_ranks=a,
        **moe_fields,
    )


MOE_PLACEMENTS = ("tp", "experts")


def _place_experts(
    n: int,
    weights: tuple[float, ...],
    n_experts: int,
    width: int,
    shared_width: int,
    down_block: int,
    moe: str,
) -> dict[str, Any]:
    """The MoE fields of a TPPlan (module docstring); none for a dense model."""
    if moe not in MOE_PLACEMENTS:
        raise TPPlanError(f"--moe {moe!r}: choose one of {', '.join(MOE_PLACEMENTS)}")
    if n_experts == 0:
        return {}
    align = math.lcm(choose_align(width, n), down_block)
    shared = ()
    if shared_width:
        shared_align = math.lcm(choose_align(shared_width, n), down_block)
        shared = split_by_weights(shared_width, weights, shared_align, "shared expert")
    if moe == "experts":
        whole = split_by_weights(n_experts, weights, 1, "experts")
        groups = tuple((ExpertGroup(s, Span(0, width)),) for s in whole)
        return dict(moe=moe, expert_groups=groups, shared_rows=shared, expert_align=1)
    if width % align:
        raise DegeneratePlanError(f"expert width {width} cannot be tiled in blocks of {align}")
    groups = deal_expert_rows(n_experts, width // align, weights, align)
    empty = [r for r, g in enumerate(groups) if not g]
    if empty:
        raise DegeneratePlanError(
            f"{n_experts} experts of {width // align} blocks of {align} rows leave rank(s) "
            f"{empty} with no expert rows at weights {weights}; use fewer ranks or less skewed "
            "weights"
        )
    return dict(moe=moe, expert_groups=groups, shared_rows=shared, expert_align=align)


def _split_attention(
    world_size: int, n_heads: int, n_kv_heads: int, weights: tuple[float, ...]
) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
    """(kv-head shards, query-head shards) per rank; see the module docstring."""
    g = n_heads // n_kv_heads
    if world_size <= n_kv_heads:
        kv = split_by_weights(n_kv_heads, weights, 1, "kv heads")
        return kv, tuple(Span(s.start * g, s.end * g) for s in kv)
    groups = split_by_weights(world_size, (1.0,) * n_kv_heads, 1, "ranks over kv groups")
    kv_out: list[Span] = []
    q_out: list[Span] = []
    for head, block in enumerate(groups):
        ranks = range(block.start, block.end)
        if len(ranks) > g:
            raise DegeneratePlanError(
                f"kv head {head} would be shared by {len(ranks)} ranks but has only {g} query "
                f"heads; use at most {n_heads} ranks spread evenly over the {n_kv_heads} kv heads"
            )
        part = split_by_weights(g, tuple(weights[r] for r in ranks), 1, f"query heads of kv {head}")
        for s in part:
            kv_out.append(Span(head, head + 1))
            q_out.append(Span(head * g + s.start, head * g + s.end))
    return tuple(kv_out), tuple(q_out)


def plan_for_config(
    config: Any,
    world_size: int,
    weights: tuple[float, ...] | None = None,
    *,
    o_block: int = 1,
    down_block: int = 1,
    attn_ranks: int | None = None,
    experts_down_block: int = 1,
    moe: str = "tp",
    linear_out_block: int = 1,
) -> TPPlan:
    """`make_tp_plan` from a `ModelConfig` (fields named like HF's config.json);
    `linear_out_block`: the block size (elements) of a hybrid's DeltaNet out_proj contraction."""
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    spec = getattr(config, "moe", None)
    moe_args = {}
    if spec is not None:
        moe_args = dict(
            n_experts=spec.num_experts,
            expert_width=spec.intermediate_size,
            shared_width=spec.shared_intermediate_size,
            experts_down_block=experts_down_block,
            moe=moe,
        )
    plan = make_tp_plan(
        world_size=world_size,
        n_heads=n_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        weights=weights,
        o_block=o_block,
        down_block=down_block,
        attn_ranks=attn_ranks,
        **moe_args,
    )
    return _with_deltanet(plan, config, linear_out_block)


def _with_deltanet(plan: TPPlan, config: Any, out_block: int = 1) -> TPPlan:
    """A hybrid's plan (Qwen3.5): gated q_proj rows, and its DeltaNet q/k heads split by the
    ranks' weights in units of `linear_align` heads (one, or more where out_proj's `out_block`
    needs it: module docstring), each with its Hv / Hk v heads. Every rank holds attention and
    DeltaNet heads: `attn_ranks` and more ranks than units are refused."""
    spec = getattr(config, "deltanet", None)
    gate = bool(getattr(config, "attn_output_gate", False))
    if spec is None:
        return replace(plan, q_gate=gate) if gate else plan
    if plan.attention_ranks < plan.world_size:
        raise TPPlanError("a hybrid (Gated DeltaNet) model places attention on every rank")
    Hk, Hv, dv = spec.num_key_heads, spec.num_value_heads, spec.value_head_dim
    tiled = spec.v_tiled and Hv != Hk  # r = 1: one order
    run_unit = dv if tiled else (Hv // Hk) * dv  # out_proj columns per q/k head along a run
    align = out_block // math.gcd(out_block, run_unit) if plan.world_size > 1 else 1
    if Hk % align:
        raise DegeneratePlanError(
            f"the Gated DeltaNet out_proj's {out_block}-element blocks need its {Hk} q/k heads "
            f"cut in units of {align} (v heads of {dv} columns), which {Hk} is not a multiple "
            "of: run it on one node or a pipeline"
        )
    heads = split_by_weights(
        Hk, plan.weights, align, "Gated DeltaNet q/k heads (linear_num_key_heads)"
    )
    dims = (Hk, Hv, spec.key_head_dim, dv)
    return replace(
        plan, q_gate=gate, linear_k_heads=heads, linear_dims=dims, linear_v_tiled=tiled,
        linear_align=align,
    )  # fmt: skip


def contraction_blocks(source: Any) -> dict[str, int]:
    """`{"o_block": b_o, "down_block": b_d, "experts_down_block": b_e, "linear_out_block": b_l}`:
    the largest block size (elements) of any layer's o_proj / down_proj / experts' down weight /
    Gated DeltaNet out_proj in `source` (a model source whose `manifest` infos carry a GGUF
    `type_id`); 1 for a dense source. The shared expert's down counts as a down_proj."""
    from tandem.models.quant.blocks import BY_ID

    out = {"o_block": 1, "down_block": 1, "experts_down_block": 1, "linear_out_block": 1}
    for name, info in getattr(source, "manifest", {}).items():
        t = BY_ID.get(getattr(info, "type_id", -1))
        if t is None:
            continue
        if name.endswith("self_attn.o_proj.weight"):
            out["o_block"] = max(out["o_block"], t.block_size)
        elif name.endswith("linear_attn.out_proj.weight"):
            out["linear_out_block"] = max(out["linear_out_block"], t.block_size)
        elif name.endswith("experts.down_proj.weight"):
            out["experts_down_block"] = max(out["experts_down_block"], t.block_size)
        elif name.endswith("down_proj.weight"):
            out["down_block"] = max(out["down_block"], t.block_size)
    return out


def plan_for_source(
    source: Any,
    world_size: int,
    weights: tuple[float, ...] | None = None,
    attn_ranks: int | None = None,
    moe: str = "tp",
) -> TPPlan:
    """`plan_for_config(source.config, ...)` with the block sizes of `source`'s weights."""
    return plan_for_config(
        source.config,
        world_size,
        weights,
        attn_ranks=attn_ranks,
        moe=moe,
        **contraction_blocks(source),
    )
