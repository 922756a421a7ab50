"""A checkpoint's expert tensors as the reference model's stacked ones.

The reference model holds each projection of a sparse layer's experts as one (E, out, in) tensor,
`model.layers.<i>.mlp.experts.{gate,up,down}_proj.weight` (`models.moe`). Checkpoints store them
otherwise:

    Qwen3-MoE (what transformers writes)   mlp.experts.<e>.{gate,up,down}_proj.weight, (out, in) each
    Mixtral                                block_sparse_moe.experts.<e>.{w1,w3,w2}.weight (gate, up,
                                           down) and block_sparse_moe.gate.weight (the router)
    fused (transformers' in-memory form)   mlp.experts.gate_up_proj (E, 2I, D): gate rows [0, I),
                                           up rows [I, 2I); mlp.experts.down_proj (E, D, I)
    gpt-oss                                mlp.experts.gate_up_proj (E, D, 2I) transposed, gate in
                                           the even columns, up in the odd ones, with
                                           gate_up_proj_bias (E, 2I) alike; down_proj (E, I, D)
                                           transposed, down_proj_bias (E, D); the router
                                           mlp.router.{weight,bias}

`expert_views(names, architecture)` maps each reference name to a `View`: where its values live. A view reads
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
_OAI_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)")
_OAI = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
GPT_OSS = "GptOssForCausalLM"
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# reads `index` (one slice per dimension) of source tensor `name`
Reader = Callable[[str, tuple[slice, ...]], "object"]


class ExpertLayoutError(MissingTensorError):
    """A checkpoint's experts are incomplete: an expert's tensor is missing."""


@dataclass(frozen=True)
class View:
    """Reference tensor (E, out, in) from `parts`: one source per expert (each (out, in)), or one
    fused source (E, rows, in) of which rows `[row0, row0 + out)` are this tensor. gpt-oss's
    (`layout`): "t" the fused source is (E, in, out), "t2" (E, in, 2 out) of which the columns
    `row0::2` are this tensor; a bias (E, out) reads `[:, row0::2]` of its (E, 2 out) source
    ("b2")."""

    parts: tuple[str, ...]
    fused: str | None = None
    row0: int = 0
    layout: str = "rows"

    def read(self, reader: Reader, shape: tuple[int, ...], dim: int | None, start, end):
        """The slice `[start, end)` of dimension `dim` (None: all) of the (E, out, in) tensor."""
        index = [slice(0, n) for n in shape]
        if dim is not None:
            index[dim] = slice(start, end)
        return self.read_index(reader, tuple(index))

    def read_index(self, reader: Reader, index: tuple[slice, ...]):
        """`index` (one slice per dimension, steps of 1) of the (E, out, in) tensor."""
        import torch

        if self.layout in ("t", "t2"):  # the source is (E, in, out) or (E, in, 2 out)
            o, step = index[1], 2 if self.layout == "t2" else 1
            cols = slice(step * o.start, step * o.stop)
            t = reader(self.fused, (index[0], index[2], cols))[..., self.row0 :: step]
            return t.transpose(1, 2).contiguous()  # (E, in, out) -> (E, out, in)
        if self.layout == "b2":  # (E, 2 out) -> (E, out)
            o = index[1]
            t = reader(self.fused, (index[0], slice(2 * o.start, 2 * o.stop)))
            return t[:, self.row0 :: 2].contiguous()
        if self.fused is not None:
            rows = index[1]
            src = (index[0], slice(self.row0 + rows.start, self.row0 + rows.stop), index[2])
            return reader(self.fused, src)
        experts = range(index[0].start, index[0].stop)
        return torch.stack([reader(self.parts[e], (index[1], index[2])) for e in experts])


def router_alias(name: str) -> str | None:
    """The reference name of a renamed tensor: a Mixtral router (`block_sparse_moe.gate` ->
    `mlp.gate`), a gpt-oss one (`mlp.router` -> `mlp.gate`) or a gpt-oss down bias."""
    m = _MIXTRAL_ROUTER.fullmatch(name)
    if m is not None:
        return f"model.layers.{m.group(1)}.mlp.gate.weight"
    m = _OAI_ROUTER.fullmatch(name)
    if m is not None:
        return f"model.layers.{m.group(1)}.mlp.gate.{m.group(2)}"
    m = _OAI.fullmatch(name)
    if m is not None and m.group(2) == "down_proj" and m.group(3):
        return f"model.layers.{m.group(1)}.mlp.experts.down_proj.bias"
    return None


def _oai_views(layer: str, proj: str, bias: bool, name: str) -> dict[str, View]:
    base = f"model.layers.{layer}.mlp.experts."
    if proj == "down_proj":
        return {} if bias else {base + "down_proj.weight": View((), name, 0, "t")}
    kind, leaf = ("b2", "bias") if bias else ("t2", "weight")
    return {
        base + f"gate_proj.{leaf}": View((), name, 0, kind),
        base + f"up_proj.{leaf}": View((), name, 1, kind),
    }


def expert_views(names: Iterable[str], architecture: str = "") -> dict[str, View]:
    """Reference name -> View for every expert projection among the checkpoint's `names`."""
    per: dict[tuple[int, str], dict[int, str]] = {}
    views: dict[str, View] = {}
    for n in names:
        if architecture == GPT_OSS:
            m = _OAI.fullmatch(n)
            if m is not None:
                views.update(_oai_views(m.group(1), m.group(2), bool(m.group(3)), n))
            continue
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
    return bool(_PER_EXPERT.fullmatch(name) or _FUSED.fullmatch(name) or _OAI.fullmatch(name))


_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.(gate|up|down)_proj|gate)\.weight")
_STACKED_ANY = re.compile(
    r"model\.layers\.(\d+)\.mlp\.(experts\.(gate|up|down)_proj|gate)\.(weight|bias)"
)
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def checkpoint_tensors(architecture: str, tensors: dict) -> dict:
    """The reference model's tensors under the names its family's checkpoints use (the inverse of
    `expert_views`): each stacked expert tensor split into one tensor per expert, Mixtral's under
    `block_sparse_moe` (w1/w3/w2) with its router. Others pass through."""
    if architecture == GPT_OSS:
        return _oai_checkpoint(tensors)
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


def _oai_checkpoint(tensors: dict) -> dict:
    """gpt-oss's names and layouts (module docstring) for the reference model's tensors."""
    import torch

    out, by_layer = {}, {}
    for name, t in tensors.items():
        m = _STACKED_ANY.fullmatch(name)
        if m is None:
            out[name] = t
        elif m.group(3) is None:  # the router
            out[f"model.layers.{m.group(1)}.mlp.router.{m.group(4)}"] = t
        else:
            by_layer.setdefault(m.group(1), {})[(m.group(3), m.group(4))] = t
    for layer, parts in by_layer.items():  # weights absent: stored as MXFP4 (`mxfp4_dir`)
        base = f"model.layers.{layer}.mlp.experts."
        if ("gate", "weight") in parts:
            gate, up = parts[("gate", "weight")], parts[("up", "weight")]  # (E, I, D)
            E, inter, D = gate.shape
            fused = torch.stack((gate, up), dim=2).reshape(E, 2 * inter, D)  # gate0 up0 gate1 ..
            out[base + "gate_up_proj"] = fused.transpose(1, 2).contiguous()  # (E, D, 2I)
            out[base + "down_proj"] = parts[("down", "weight")].transpose(1, 2).contiguous()
        if ("gate", "bias") in parts:
            gb, ub = parts[("gate", "bias")], parts[("up", "bias")]  # (E, I)
            out[base + "gate_up_proj_bias"] = torch.stack((gb, ub), dim=2).flatten(1)
            out[base + "down_proj_bias"] = parts[("down", "bias")]
    return out
