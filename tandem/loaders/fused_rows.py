"""A checkpoint's fused projections as the reference model's separate ones, by rows.

A family may store several projections of a layer as one tensor whose rows are the parts one
after the other (Phi-3: `self_attn.qkv_proj` = [q; k; v], `mlp.gate_up_proj` = [gate; up];
`models.families.phi3.fused_rows`). The reference model holds the parts; each is a `RowSlice` of
the fused source, rows [row0, row0 + rows): reading rows [a, b) of a part reads rows
[row0 + a, row0 + b) of the source and nothing else, so a TP rank's column-parallel shard of q
(whole heads), k, v, gate or up touches only its own rows of the fused tensor. `fuse` is the
inverse, for writers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.loaders.errors import TensorShapeError

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")

# fused leaf (relative to `model.layers.<i>.`) -> its parts in row order: (part leaf, rows)
Rules = dict[str, tuple[tuple[str, int], ...]]


@dataclass(frozen=True)
class RowSlice:
    """Reference tensor = rows [row0, row0 + rows) of checkpoint tensor `source`."""

    source: str
    row0: int
    rows: int


def row_views(names: Iterable[str], rules: Rules) -> dict[str, RowSlice]:
    """Reference name -> RowSlice for every part of every fused tensor among `names`."""
    views: dict[str, RowSlice] = {}
    for name in names:
        m = _LAYER.fullmatch(name)
        if m is None or m.group(2) not in rules:
            continue
        row0 = 0
        for part, rows in rules[m.group(2)]:
            views[f"model.layers.{m.group(1)}.{part}.{m.group(3)}"] = RowSlice(name, row0, rows)
            row0 += rows
    return views


def fused_total(rules: Rules, source: str) -> int | None:
    """The rows fused tensor `source` must have under `rules` (None: not a fused tensor)."""
    m = _LAYER.fullmatch(source)
    if m is None or m.group(2) not in rules:
        return None
    return sum(rows for _, rows in rules[m.group(2)])


def check_rows(source: str, rows: int, rules: Rules, where: str) -> None:
    """TensorShapeError unless fused tensor `source` has exactly its parts' rows."""
    want = fused_total(rules, source)
    if want is not None and rows != want:
        raise TensorShapeError(
            f"{where}: fused tensor {source!r} has {rows} rows, its parts need {want}"
        )


def fuse(tensors: dict, rules: Rules) -> dict:
    """The reference model's tensors with each rule's parts stacked by rows into the fused
    tensor a checkpoint holds (the inverse of `row_views`); others pass through."""
    import torch

    out, parts = {}, {}
    owner = {part: fused for fused, ps in rules.items() for part, _ in ps}
    for name, t in tensors.items():
        m = _LAYER.fullmatch(name)
        if m is None or m.group(2) not in owner:
            out[name] = t
            continue
        parts.setdefault((m.group(1), owner[m.group(2)], m.group(3)), {})[m.group(2)] = t
    for (layer, fused, leaf), got in parts.items():
        rows = [got[part] for part, _ in rules[fused]]
        out[f"model.layers.{layer}.{fused}.{leaf}"] = torch.cat(rows, dim=0).contiguous()
    return out


def rules_for(config) -> Rules:
    """The fused-projection rules of `config`'s family (`Family.fused_rows`; none for most)."""
    return config.family.fused_rows(config)
