"""A checkpoint's expert tensors as the reference model's stacked ones.

The reference model holds each projection of a sparse layer's experts as one (E, out, in) tensor,
`model.layers.<i>.mlp.experts.{gate,up,down}_proj.weight` (`models.moe`). Checkpoints store them
otherwise:

    Qwen3-MoE (what transformers writes)   mlp.experts.<e>.{gate,up,down}_proj.weight, (out, in) each
    Mixtral                                block_sparse_moe.experts.<e>.{w1,w3,w2}.weight (gate, up,
                                           down) and block_sparse_moe.gate.weight (the router)
    fused (transformers' in-memory form)   mlp.experts.gate_up_proj (E, 2I, D): gate rows [0, I),
                                           up rows [I, 2I); mlp.experts.down_proj (E, D, I)

`expert_views(names)` maps each reference name to a `View`: where its values live. A view reads
any half-open slice of one dimension, touching only those bytes of the sources (each expert's
tensor or the fused tensor is sliced, never read whole), so a TP rank reads its rows of every
expert and an expert-parallel rank only its experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.loaders.errors import MissingTensorError

_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight"
)
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_MIXTRAL_ROUTER = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# reads `index` (one slice per dimension) of source tensor `name`
Reader = Callable[[str, tuple[slice, ...]], "object"]


class ExpertLayoutError(MissingTensorError):
    """A checkpoint's experts are incomplete: an expert's tensor is missing."""


@dataclass(frozen=True)
class View:
    """Reference tensor (E, out, in) from `parts`: one source per expert (each (out, in)), or one
    fused source (E, rows, in) of which rows `[row0, row0 + out)` are this tensor."""

    parts: tuple[str, ...]
    fused: str | None = None
    row0: int = 0

    def read(self, reader: Reader, shape: tuple[int, ...], dim: int | None, start, end):
        """The slice `[start, end)` of dimension `dim` (None: all) of the (E, out, in) tensor."""
        import torch

        index = [slice(0, n) for n in shape]
        if dim is not None:
            index[dim] = slice(start, end)
        if self.fused is not None:
            rows = index[1]
            src = (index[0], slice(self.row0 + rows.start, self.row0 + rows.stop), index[2])
            return reader(self.fused, src)
        experts = range(index[0].start, index[0].stop)
        return torch.stack([reader(self.parts[e], (index[1], index[2])) for e in experts])


def router_alias(name: str) -> str | None:
    """The reference name of a Mixtral router tensor (`block_sparse_moe.gate` -> `mlp.gate`)."""
    m = _MIXTRAL_ROUTER.fullmatch(name)
    return None if m is None else f"model.layers.{m.group(1)}.mlp.gate.weight"


def expert_views(names: Iterable[str]) -> dict[str, View]:
    """Reference name -> View for every expert projection among the checkpoint's `names`."""
    per: dict[tuple[int, str], dict[int, str]] = {}
    views: dict[str, View] = {}
    for n in names:
        m = _PER_EXPERT.fullmatch(n)
        if m is not None:
            proj = _PROJ.get(m.group(4), m.group(4))
            per.setdefault((int(m.group(1)), proj), {})[int(m.group(3))] = n
            continue
        m = _FUSED.fullmatch(n)
        if m is not None:
            base = f"model.layers.{m.group(1)}.mlp.experts."
            if m.group(2) == "down_proj":
                views[base + "down_proj.weight"] = View((), n)
            else:
                views[base + "gate_proj.weight"] = View((), n, 0)
                views[base + "up_proj.weight"] = View((), n, -1)  # row0 set from the shape
    for (layer, proj), by_expert in per.items():
        n = len(by_expert)
        if sorted(by_expert) != list(range(n)):
            missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
            raise ExpertLayoutError(f"layer {layer} {proj}: expert(s) {missing} missing")
        views[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = View(
            tuple(by_expert[e] for e in range(n))
        )
    return views


def is_expert_source(name: str) -> bool:
    """Whether checkpoint tensor `name` feeds a View (so it is not a parameter by itself)."""
    return bool(_PER_EXPERT.fullmatch(name) or _FUSED.fullmatch(name))


_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.(gate|up|down)_proj|gate)\.weight")
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def checkpoint_tensors(architecture: str, tensors: dict) -> dict:
    """The reference model's tensors under the names its family's checkpoints use (the inverse of
    `expert_views`): each stacked expert tensor split into one tensor per expert, Mixtral's under
    `block_sparse_moe` (w1/w3/w2) with its router. Others pass through."""
    out = {}
    mixtral = architecture == "MixtralForCausalLM"
    for name, t in tensors.items():
        m = _STACKED.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer = m.group(1)
        if m.group(3) is None:  # the router
            block = "block_sparse_moe" if mixtral else "mlp"
            out[f"model.layers.{layer}.{block}.gate.weight"] = t
            continue
        for e in range(t.shape[0]):
            if mixtral:
                key = f"block_sparse_moe.experts.{e}.{_MIXTRAL_PROJ[m.group(3)]}"
            else:
                key = f"mlp.experts.{e}.{m.group(3)}_proj"
            out[f"model.layers.{layer}.{key}.weight"] = t[e].contiguous()
    return out
