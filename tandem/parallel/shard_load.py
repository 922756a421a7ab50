"""Shard-only loading: each rank reads exactly its own slices from the safetensors files.

`slice_spec` maps a parameter of the TP-sharded model to the half-open slice of its checkpoint
tensor that this rank owns (`(dim, start, end)`, or `None` for a replicated tensor); the loader's
slice read (safetensors `get_slice`) then reads only those bytes, so the full tensor is never
materialized on a rank:

    q_proj.{weight,bias}            dim 0, the rank's query-head rows     [a g hd, b g hd)
    k_proj, v_proj .{weight,bias}   dim 0, the rank's kv-head rows        [a hd, b hd)
    o_proj.weight                   dim 1, the rank's query-head columns  [a g hd, b g hd)
    gate_proj, up_proj .{w,b}       dim 0, the rank's intermediate rows
    down_proj.weight                dim 1, the rank's intermediate columns
    embed_tokens.weight, lm_head    dim 0, the rank's vocabulary rows
    everything else (norms, o/down biases)   replicated
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tandem.parallel.plan import TPPlan


class ShardLoadError(RuntimeError):
    """A parameter of the sharded model has no checkpoint source, or the slice has the wrong shape."""


class SliceReader(Protocol):
    """What `load_shard` needs from a checkpoint (`ModelDir`)."""

    def read(
        self, name: str, dim: int | None = None, start: int | None = None, end: int | None = None
    ) -> torch.Tensor: ...


def slice_spec(param_name: str, plan: TPPlan, rank: int) -> tuple[int, int, int] | None:
    """`(dim, start, end)` of the checkpoint tensor behind `param_name` owned by `rank`."""
    parts = param_name.split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) >= 2 else ""
    if module == "q_proj":
        s = plan.q_rows(rank)
        return (0, s.start, s.end)
    if module in ("k_proj", "v_proj"):
        s = plan.kv_rows(rank)
        return (0, s.start, s.end)
    if module == "o_proj" and leaf == "weight":
        s = plan.q_rows(rank)
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


def load_shard(model: nn.Module, reader: SliceReader, plan: TPPlan, rank: int) -> int:
    """Fills every parameter of a `shard_transformer` model from `reader`, one slice read each
    (tied parameters once), converting to the parameter's dtype. Returns the bytes read."""
    nbytes = 0
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters are listed once
            source = model.checkpoint_name(name)
            spec = slice_spec(name, plan, rank)
            t = reader.read(source) if spec is None else reader.read(source, *spec)
            if tuple(t.shape) != tuple(p.shape):
                raise ShardLoadError(
                    f"{name}: checkpoint slice {spec} of {source} has shape {tuple(t.shape)}, the "
                    f"rank-{rank} shard needs {tuple(p.shape)}"
                )
            p.copy_(t)
            nbytes += t.numel() * t.element_size()
            del t
            close = getattr(reader, "close", None)
            if close is not None:
                # drop the file mapping: a column slice touches every page of its tensor, and
                # mapped pages count as this process's resident memory while the file stays open
                close()
    return nbytes
