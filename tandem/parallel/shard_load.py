"""Shard-only loading: each rank reads exactly its own slices from the safetensors files.

`slice_spec` maps a parameter of the TP-sharded model to the half-open slice of its checkpoint
tensor that this rank owns (`(dim, start, end)`, or `None` for a replicated tensor); the loader's
slice read (safetensors `get_slice`) then reads only those bytes, so the full tensor is never
materialized on a rank:

    q_proj.{weight,bias}            dim 0, the rank's query-head rows     [a g hd, b g hd)
    k_proj, v_proj .{weight,bias}   dim 0, the rank's kv-head rows        [a hd, b hd)
    o_proj.weight                   dim 1, `plan.o_columns(r)`: the rank's query-head columns
                                    [a g hd, b g hd), or its block-aligned columns ("gather")
    gate_proj, up_proj .{w,b}       dim 0, the rank's intermediate rows
    down_proj.weight                dim 1, the rank's intermediate columns
    embed_tokens.weight, lm_head    dim 0, the rank's vocabulary rows
    mlp.experts.{gate,up}_proj      (E, out, in), per group g of the rank (`TPPlan.expert_groups`,
    (and mlp.expert_groups.<g>.*)   experts [f, l), rows [a, b)): "tp" dim 1 [a, b) of experts
                                    [f, l); "experts" dim 0 [f, l), the rank's whole experts
    mlp.experts.down_proj           (E, D, width): "tp" dim 2 [a, b) (the same rows as columns)
                                    of experts [f, l); "experts" dim 0
    mlp.experts.{gate,up}_proj.bias (E, width): as the weights' rows; the down bias (E, D) dim 0
                                    [f, l), in the group that adds it (`holds_down_bias`)
    self_attn.sinks                 dim 0, the rank's query heads
    mlp.shared_expert.*             as gate/up/down over `plan.shared_rows`
    linear_attn.*                   the rank's Gated DeltaNet heads' rows (out_proj: columns),
                                    `plan` docstring; several runs concatenated (`linear_ranges`)
    everything else (norms, o/down biases, the MoE router)   replicated

A slice of experts [f, l) along another dim is `(dim, start, end, (f, l))`: the readers' `experts`
argument, reading only those experts' bytes of the slice.

A GGUF source's quantized tensors fill the layers' `quant` modules with the same slices, read as
blocks (`GGUFModel.blocks(name, dim, start, end)`: a row slice is a view of the mapped file, a
column slice a copy of exactly the rank's bytes of every row); nothing is dequantized at load time
and the rest of each tensor is never read. A tied LM head shares the embedding's blocks. A
DeltaNet tensor of several runs concatenates their blocks: row runs along the rows, out_proj's
column runs (edges on its blocks, `TPPlan.linear_align`) along each row's bytes, a row of
`cols / B` blocks being the concatenation of its runs' `(end - start) / B` blocks.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tandem.models.quant.linear import QuantEmbedding, QuantExpertLinear, QuantLinear
from tandem.parallel.moe import expert_group_of
from tandem.parallel.plan import TPPlan

SliceSpec = tuple[int, int, int] | tuple[int, int, int, tuple[int, int]]


class ShardLoadError(RuntimeError):
    """A parameter of the sharded model has no checkpoint source, or the slice has the wrong shape."""


class SliceReader(Protocol):
    """What `load_shard` needs from a checkpoint (`ModelDir`)."""

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int | None = None,
        end: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor: ...


def source_name(model: nn.Module, param_name: str) -> str:
    """The checkpoint tensor behind a parameter (or module) name of the sharded model: a tied
    head's embedding, a group of experts' `mlp.experts.*` (`parallel.moe`)."""
    return model.checkpoint_name(expert_group_of(param_name)[0])


def slice_spec(param_name: str, plan: TPPlan, rank: int) -> SliceSpec | None:
    """`(dim, start, end)` of the checkpoint tensor behind `param_name` owned by `rank`, or
    `(dim, start, end, (f, l))` for a group of experts' rows (module docstring)."""
    param_name, group = expert_group_of(param_name)
    parts = param_name.split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) >= 2 else ""
    owner = parts[-3] if len(parts) >= 3 else ""
    if owner == "experts":
        g = plan.expert_groups[rank][group]
        e, rows = g.experts, g.rows
        if plan.moe == "experts" or module == "down_proj" and leaf == "bias":
            return (0, e.start, e.end)
        dim = 2 if module == "down_proj" else 1
        return (dim, rows.start, rows.end, (e.start, e.end))
    if owner == "shared_expert":
        s = plan.shared_rows[rank]
        if module == "down_proj":
            return (1, s.start, s.end) if leaf == "weight" else None
        return (0, s.start, s.end)
    if leaf == "sinks":
        s = plan.q_heads(rank)
        return (0, s.start, s.end)
    if owner == "linear_attn" or module == "linear_attn":
        return _linear_attn_spec(module if owner == "linear_attn" else "", leaf, plan, rank)
    if module == "q_proj":
        s = plan.q_proj_rows(rank)
        return (0, s.start, s.end)
    if module in ("k_proj", "v_proj"):
        s = plan.kv_rows(rank)
        return (0, s.start, s.end)
    if module == "o_proj" and leaf == "weight":
        s = plan.o_columns(rank)
        return (1, s.start, s.end)
    if module in ("gate_proj", "up_proj"):
        s = plan.intermediate[rank]
        return (0, s.start, s.end)
    if module == "down_proj" and leaf == "weight":
        s = plan.intermediate[rank]
        return (1, s.start, s.end)
    if param_name in ("model.embed_tokens.weight", "lm_head.weight"):
        s = plan.vocab[rank]
        return (0, s.start, s.end)
    return None


def _linear_v_ranges(
    module: str, leaf: str, plan: TPPlan, rank: int
) -> list[tuple[int, int, int]] | None:
    """A per-v-head Gated DeltaNet tensor's (dim, start, end) runs owned by `rank`, in the
    order its shard holds them (one run; r where the v heads are tiled: `plan.linear_v_spans`);
    None for any other tensor."""
    dv = plan.linear_dims[3]
    spans = plan.linear_v_spans(rank)
    if module in ("in_proj_a", "in_proj_b") or leaf in ("A_log", "dt_bias"):
        return [(0, v.start, v.end) for v in spans]
    if module == "in_proj_z":
        return [(0, v.start * dv, v.end * dv) for v in spans]
    if module == "out_proj":
        return [(1, v.start * dv, v.end * dv) for v in spans]
    return None  # the gated norm (per v head, dv wide): replicated


def _linear_attn_spec(
    module: str, leaf: str, plan: TPPlan, rank: int
) -> tuple[int, int, int] | None:
    """A Gated DeltaNet tensor's slice owned by `rank` (`plan` module docstring), where it is
    one range; in_proj_qkv and conv1d (three ranges or more), and with tiled v heads every
    per-v-head tensor, are `linear_ranges`' (None here)."""
    runs = _linear_v_ranges(module, leaf, plan, rank)
    return runs[0] if runs is not None and len(runs) == 1 else None


def linear_ranges(param_name: str, plan: TPPlan, rank: int) -> list[tuple[int, int, int]] | None:
    """The (dim, start, end) runs of a Gated DeltaNet tensor owned by `rank` where they are more
    than one, concatenated in order along their dim: in_proj_qkv / conv1d's rows (q, k, then
    the v runs), and with tiled v heads in_proj_z / in_proj_a / in_proj_b / A_log / dt_bias's
    rows and out_proj's columns; None for any other tensor."""
    parts = param_name.split(".")
    if "linear_attn" not in parts:
        return None
    at = parts.index("linear_attn")
    module = parts[at + 1] if len(parts) > at + 2 else ""
    if module in ("in_proj_qkv", "conv1d"):
        return [(0, s.start, s.end) for s in plan.linear_qkv_rows(rank)]
    runs = _linear_v_ranges(module, parts[-1], plan, rank)
    return runs if runs is not None and len(runs) > 1 else None


def quant_types(source: object) -> dict[str, int]:
    """Checkpoint name -> GGUF block type of every quantized tensor of `source` (`{}` for a
    dense source): what `shard_transformer(qtypes=...)` builds over blocks."""
    manifest = getattr(source, "manifest", {})
    return {n: i.type_id for n, i in manifest.items() if getattr(i, "quantized", False)}


def _load_quant(model: nn.Module, reader, plan: TPPlan, rank: int) -> int:
    """Fills every layer's `quant` module with this rank's blocks; returns the bytes read."""
    device = next(p.device for p in model.parameters() if not p.is_meta)
    shared: dict[tuple, torch.Tensor] = {}  # (checkpoint name, slice) -> blocks (a tied head: once)
    nbytes = 0
    for mname, mod in model.named_modules():
        q = mod if isinstance(mod, QuantExpertLinear) else getattr(mod, "quant", None)
        if not isinstance(q, (QuantLinear, QuantEmbedding, QuantExpertLinear)):
            continue
        source = source_name(model, mname + ".weight")
        spec = slice_spec(mname + ".weight", plan, rank)
        runs = linear_ranges(mname + ".weight", plan, rank) if plan.linear_k_heads else None
        blocks = shared.get((source, spec))
        if blocks is None:
            info = reader.info(source)
            if info.type_id != q.qtype:
                raise ShardLoadError(f"{mname}: built for type {q.qtype}, {source} is {info.dtype}")
            if runs is not None:  # a DeltaNet tensor's runs: rows, or out_proj's whole blocks
                blocks = torch.cat([reader.blocks(source, *r) for r in runs], dim=runs[0][0])
            elif spec is None:
                blocks = reader.blocks(source)
            else:
                blocks = reader.blocks(source, *spec)
            blocks = shared[(source, spec)] = blocks.to(device)
            nbytes += blocks.numel()
        if tuple(blocks.shape) != tuple(q.qweight.shape):
            raise ShardLoadError(
                f"{mname}: blocks {spec} of {source} have shape {tuple(blocks.shape)}, the "
                f"rank-{rank} shard needs {tuple(q.qweight.shape)}"
            )
        q.qweight = blocks
    return nbytes


def load_shard(model: nn.Module, reader: SliceReader, plan: TPPlan, rank: int) -> int:
    """Fills every parameter of a `shard_transformer` model from `reader`, one slice read each
    (tied parameters once), converting to the parameter's dtype, and every quantized layer with
    its blocks (module docstring). Returns the bytes read."""
    quantized = hasattr(reader, "blocks")
    nbytes = _load_quant(model, reader, plan, rank) if quantized else 0
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters are listed once
            source = source_name(model, name)
            spec = slice_spec(name, plan, rank)
            ranges = linear_ranges(name, plan, rank) if plan.linear_k_heads else None
            if ranges is not None:  # several runs of one tensor (DeltaNet's q, k, v; tiled v)
                t = torch.cat([reader.read(source, *r) for r in ranges], dim=ranges[0][0])
            else:
                t = reader.read(source) if spec is None else reader.read(source, *spec)
            if tuple(t.shape) != tuple(p.shape) and _squeezed(t.shape) == _squeezed(p.shape):
                t = t.reshape(p.shape)  # a GGUF file drops size-1 dims (`GGUFModel.check`)
            if tuple(t.shape) != tuple(p.shape):
                raise ShardLoadError(
                    f"{name}: checkpoint slice {spec} of {source} has shape {tuple(t.shape)}, the "
                    f"rank-{rank} shard needs {tuple(p.shape)}"
                )
            p.copy_(t)
            nbytes += t.numel() * t.element_size()
            del t
            close = None if quantized else getattr(reader, "close", None)
            if close is not None:
                # drop the file mapping: a column slice touches every page of its tensor, and
                # mapped pages count as this process's resident memory while the file stays open
                close()
    return nbytes


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)
