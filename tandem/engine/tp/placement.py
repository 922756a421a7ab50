"""Placement checks of a forming TP group that are pure given the model and the gathered rank
facts: whether an `auto` split plans on the model's blocks (`plannable`, and the refinement's
proposal, `refinement`), and whether the plan fits each rank's memory (`check_group_fit`, over
`parallel.fit`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tandem.devices import DTYPE_NAMES
from tandem.engine.tp.probe import RankProbe, WeightsChoice
from tandem.engine.tp.refine import refined_weights
from tandem.loaders.source import ModelSource
from tandem.models.quant.blocks import BY_ID
from tandem.parallel.fit import check_fit, rank_needs, share_host_memory
from tandem.parallel.plan import DegeneratePlanError, plan_for_source

if TYPE_CHECKING:
    from tandem.engine.tp.layout import GroupLayout, RankInfo


def _f32(weights: tuple[float, ...]) -> tuple[float, ...]:
    """The weights as they survive the float32 wire, so the head plans with the workers' values."""
    return tuple(torch.tensor(weights, dtype=torch.float32).tolist())


def plannable(
    md: ModelSource,
    world_size: int,
    attn_ranks: int | None,
    choice: WeightsChoice,
    moe: str = "tp",
) -> WeightsChoice:
    """An "auto" choice that the model's blocks cannot realize (a rank left with no kv head or
    no block at the probed ratio: `DegeneratePlanError`) tempered toward the equal split, weights
    w -> w^a for a = 3/4, 1/2, 1/4, 0 until the plan forms; other choices as they are (a given
    split that does not plan is the user's to change, and is refused with the plan's error)."""
    if choice.how != "auto":
        return choice
    for a in (1.0, 0.75, 0.5, 0.25, 0.0):
        w = _f32(tuple(round(x**a, 3) for x in choice.weights))
        try:
            plan_for_source(md, world_size, w, attn_ranks, moe)
        except DegeneratePlanError:
            continue
        if a == 1.0:
            return choice
        why = f"{choice.why}; tempered to the power {a:g}: the model's blocks leave a rank no work"
        return replace(choice, weights=w, why=why)
    return choice  # the equal split does not plan either: the caller raises the plan's error


def refinement(
    md: ModelSource, layout: GroupLayout, shares: list[float], clocks: list[tuple[float, int]]
) -> tuple[float, ...] | None:
    """The head's proposal from the warm-up clocks (`tp.refine.refined_weights`), kept only where
    the model's blocks can realize it."""
    new = refined_weights(shares, layout.weights, clocks)
    if new is None:
        return None
    try:
        plan_for_source(md, layout.world_size, _f32(new), layout.attn_ranks or None, layout.moe)
    except DegeneratePlanError:
        return None
    return new


def stored_bytes_per_elem(md: ModelSource) -> float:
    """Stored bytes per element over the model's matrices (2-D tensors), each at its ggml type's
    block bytes / block size: what a rank holds of a quantized file per weight element."""
    total_bytes = total_elems = 0.0
    for name in md.manifest:
        info = md.info(name)
        if len(info.shape) != 2:
            continue
        t = BY_ID[info.type_id]
        n = info.shape[0] * info.shape[1]
        total_elems += n
        total_bytes += n / t.block_size * t.block_bytes
    return total_bytes / total_elems if total_elems else 0.0


def check_group_fit(
    md: ModelSource, layout: GroupLayout, ranks: list[RankInfo], probes: list[RankProbe]
) -> None:
    """Every rank, before any shard is loaded: each rank's share of the weights and its KV cache
    at the agreed batch and length against the free memory its probe measured
    (`parallel.fit`); a plan that does not fit raises `PlanDoesNotFitError` on every rank at once
    (the same inputs everywhere), naming the rank and the bytes. A dense checkpoint's weights are
    counted in each rank's compute dtype, a quantized one's at the file's stored bytes per element
    (`stored_bytes_per_elem`: blocks stay quantized); CPU ranks of one host share its RAM
    (`parallel.fit.share_host_memory`)."""
    elem = [torch.tensor([], dtype=DTYPE_NAMES[r.dtype]).element_size() for r in ranks]
    fmt = md.weight_format()
    dense = fmt.startswith("safetensors") and "quantized" not in fmt
    stored = None if dense else stored_bytes_per_elem(md)
    free = [int(p.free_gb * 1e9) for p in probes]
    hosts = [r.host if r.device == "cpu" else None for r in ranks]
    needs = rank_needs(
        md.config,
        layout.plan(md),
        elem_bytes=elem,
        weight_bytes_per_elem=[e if stored is None else stored for e in elem],
        free_bytes=share_host_memory(free, hosts),
        max_batch=layout.max_batch,
        max_seq_len=layout.max_seq_len,
    )
    check_fit(needs)
