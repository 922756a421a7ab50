"""`Mxfp4ModelDir`: a gpt-oss safetensors directory whose experts are stored in MXFP4 (config.json
`quantization_config.quant_method` "mxfp4": OpenAI's released checkpoints), as a model source whose
experts stay in their blocks. `gguf.load.load_gguf_model` builds it as it builds a GGUF file's
MXFP4 experts (`QuantExpertLinear`), and TP / expert-parallel ranks shard it on block boundaries
(`parallel.shard_load`):

    model.layers.<i>.mlp.experts.gate_up_proj_{blocks,scales}   (E, 2I, D/32, 16) / (E, 2I, D/32)
        gate in the even rows, up in the odd ones (the dense checkpoint's interleaving)
        -> mlp.experts.gate_proj.weight, mlp.experts.up_proj.weight    MXFP4 (E, I, D)
    model.layers.<i>.mlp.experts.down_proj_{blocks,scales}      (E, D, I/32, 16) / (E, D, I/32)
        -> mlp.experts.down_proj.weight                                MXFP4 (E, D, I)
    everything else (the experts' biases, router, attention, norms, embeddings, head: bf16)
        -> read as the dense `ModelDir` reads it

`blocks(name, dim, start, end)` repacks only the slice asked for into ggml's 17-byte blocks
(`mxfp4_layout`: the exponent byte as stored, the nibbles reordered) and reads only its bytes of
the file: whole experts (dim 0), rows of every expert (dim 1: gate or up rows [a, b) are the
file's rows [2a, 2b), every other one kept) or columns on 32-element block edges (dim 2). The
repacked blocks are the one copy held (17 bytes per 32 weights); nothing is dequantized. A
layer's experts stored as floats (`gate_up_proj` without `_blocks`) are read as floats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.loaders.errors import CorruptFileError, TensorDtypeError, TensorShapeError
from tandem.loaders.mxfp4_layout import BLOCK, PACKED, ggml_from_openai, openai_from_ggml
from tandem.loaders.safetensors_dir import FLOAT_CODES, ModelDir
from tandem.models.quant.blocks import BY_ID, BY_NAME, QUANTIZED

if TYPE_CHECKING:
    import torch

MXFP4 = BY_NAME["MXFP4"].type_id
_SOURCE = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)"
)


class Mxfp4LayoutError(CorruptFileError):
    """An MXFP4 expert tensor without its partner (`_blocks` / `_scales`), of another dtype, or
    of a shape that does not pair with it."""


class Mxfp4SliceError(TensorShapeError):
    """A slice outside an MXFP4 expert weight, or columns off its 32-element blocks."""


@dataclass(frozen=True)
class Mxfp4TensorInfo:
    file: Path
    type_id: int  # ggml type: MXFP4 for the experts, F32 / F16 / BF16 for the rest
    shape: tuple[int, ...]  # the reference model's: (E, out, in) for the experts

    @property
    def dtype(self) -> str:
        return BY_ID[self.type_id].name

    @property
    def quantized(self) -> bool:
        return self.type_id in QUANTIZED

    @property
    def nbytes(self) -> int:
        """Bytes held: 17 per 32 weights for MXFP4 (as in the file: 16 of codes, 1 scale)."""
        n = BY_ID[self.type_id].row_bytes(self.shape[-1])
        for d in self.shape[:-1]:
            n *= d
        return n


@dataclass(frozen=True)
class _Experts:
    """Where an MXFP4 expert weight lives: rows `row0::step` of the file's blocks and scales."""

    blocks: str
    scales: str
    row0: int
    step: int


class Mxfp4ModelDir:
    """`md`'s tensors with its MXFP4 experts as ggml blocks (module docstring)."""

    def __init__(self, md: ModelDir) -> None:
        self.md = md
        self.config = md.config
        self.path = md.path
        self.manifest: dict[str, Mxfp4TensorInfo] = {}
        pairs: dict[tuple[str, str], dict[str, str]] = {}
        for name, info in md.manifest.items():
            m = _SOURCE.fullmatch(name)
            if m is not None:
                pairs.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = name
            elif info.dtype in FLOAT_CODES:
                self.manifest[name] = Mxfp4TensorInfo(
                    info.file, BY_NAME[info.dtype].type_id, info.shape
                )
        self._experts: dict[str, _Experts] = {}
        for (layer, proj), names in sorted(pairs.items()):
            self._add_experts(layer, proj, names)

    def _add_experts(self, layer: str, proj: str, names: dict[str, str]) -> None:
        stem = f"model.layers.{layer}.mlp.experts.{proj}"
        if set(names) != {"blocks", "scales"}:
            raise Mxfp4LayoutError(
                f"{self.path}: {stem}_{next(iter(names))} has no {stem}_"
                f"{({'blocks', 'scales'} - set(names)).pop()}"
            )
        b, s = self.md.info(names["blocks"]), self.md.info(names["scales"])
        if (b.dtype, s.dtype) != ("U8", "U8") or (
            len(b.shape) != 4 or b.shape[-1] != PACKED or b.shape[:-1] != s.shape
        ):
            raise Mxfp4LayoutError(
                f"{b.file}: {stem}_blocks {b.dtype}{list(b.shape)} and _scales "
                f"{s.dtype}{list(s.shape)}: want U8 (E, rows, cols/32, 16) and U8 (E, rows, cols/32)"
            )
        e, rows, groups = s.shape
        parts = (
            {"down_proj": (0, 1)}
            if proj == "down_proj"
            else {"gate_proj": (0, 2), "up_proj": (1, 2)}
        )
        for part, (row0, step) in parts.items():
            ref = f"model.layers.{layer}.mlp.experts.{part}.weight"
            if ref in self.manifest:
                raise Mxfp4LayoutError(f"{b.file}: {ref} is stored both as floats and as MXFP4")
            if rows % step:
                raise Mxfp4LayoutError(f"{b.file}: {stem}_blocks has an odd row count {rows}")
            self._experts[ref] = _Experts(names["blocks"], names["scales"], row0, step)
            self.manifest[ref] = Mxfp4TensorInfo(b.file, MXFP4, (e, rows // step, groups * BLOCK))

    def info(self, name: str) -> Mxfp4TensorInfo:
        info = self.manifest.get(name)
        if info is not None:
            return info
        if name in self.md.manifest:  # a tensor in a dtype the model does not take as a weight
            raw = self.md.info(name)
            raise TensorDtypeError(
                f"{raw.file}: tensor {name!r} is {raw.dtype}; weights must be one of "
                f"{', '.join(FLOAT_CODES)} (or MXFP4 experts)"
            )
        return self.md.info(name)  # the missing-tensor error naming the directory

    def check(self, name: str, shape: tuple[int, ...]) -> Mxfp4TensorInfo:
        """`info(name)`, after checking its shape is `shape`."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise TensorShapeError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, the config implies "
                f"{list(shape)}"
            )
        return info

    def blocks(
        self,
        name: str,
        dim: int | None = None,
        start: int | None = None,
        end: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """MXFP4 expert weight `name` (E, out, in) as ggml blocks uint8 (E', out', in' / 32 * 17):
        the whole of it, or the slice `[start, end)` of dimension `dim` (module docstring), of
        experts [e0, e1) only where `experts` says so."""
        import torch

        src = self._experts.get(name)
        info = self.info(name)
        if src is None:
            raise TensorDtypeError(
                f"{info.file}: tensor {name!r} is {info.dtype}, not MXFP4 blocks"
            )
        index = [slice(0, info.shape[0]), slice(0, info.shape[1]), slice(0, info.shape[2] // BLOCK)]
        if dim is not None:
            if dim not in (0, 1, 2):
                raise Mxfp4SliceError(f"{name!r}: slice dimension {dim} (0, 1 or 2)")
            size, align = info.shape[dim], BLOCK if dim == 2 else 1
            if start is None or end is None or not 0 <= start < end <= size:
                raise Mxfp4SliceError(
                    f"{info.file}: [{start}, {end}) of dim {dim} outside {name!r} {info.shape}"
                )
            if start % align or end % align:
                raise Mxfp4SliceError(
                    f"{info.file}: columns [{start}, {end}) of {name!r} are off its 32-element "
                    f"MXFP4 blocks"
                )
            index[dim] = slice(start // align, end // align)
        if experts is not None:
            e0, e1 = experts
            if dim == 0 or not 0 <= e0 < e1 <= info.shape[0]:
                raise Mxfp4SliceError(f"{info.file}: experts [{e0}, {e1}) of {name!r} {info.shape}")
            index[0] = slice(e0, e1)
        r = index[1]
        rows = slice(src.step * r.start, src.step * r.stop)  # gate/up: both halves' rows
        b = self.md.read_source(src.blocks, (index[0], rows, index[2], slice(0, PACKED)))
        s = self.md.read_source(src.scales, (index[0], rows, index[2]))
        b, s = b[:, src.row0 :: src.step].numpy(), s[:, src.row0 :: src.step].numpy()
        return torch.from_numpy(ggml_from_openai(b, s))

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int | None = None,
        end: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Tensor `name` as values: an MXFP4 expert weight (or its slice) dequantized to float32,
        anything else as `ModelDir.read` gives it."""
        if name not in self._experts:
            return self.md.read(name, dim, start, end, experts)
        from tandem.models.quant.dequant import dequantize

        q = self.blocks(name, dim, start, end, experts)  # (E', out', row_bytes)
        cols = q.shape[-1] // BY_ID[MXFP4].block_bytes * BLOCK
        return dequantize(q.reshape(-1, q.shape[-1]), MXFP4).view(*q.shape[:-1], cols)

    def fingerprint(self) -> str:
        """The directory's (its config states the quant method, its manifest the block tensors)."""
        return self.md.fingerprint()

    def weight_format(self) -> str:
        """ "safetensors BF16, MXFP4 experts": the float tensors' dtypes (the one holding the most
        bytes first), then the experts'."""
        size: dict[str, int] = {}
        for name, info in self.manifest.items():
            if not info.quantized:
                size[info.dtype] = size.get(info.dtype, 0) + self.md.info(name).nbytes
        return f"safetensors {'/'.join(sorted(size, key=lambda d: -size[d]))}, MXFP4 experts"

    def tokenizer(self):
        return self.md.tokenizer()

    def close(self) -> None:
        self.md.close()


def mxfp4_checkpoint(tensors: dict) -> dict:
    """The writer's inverse of `Mxfp4ModelDir`: the reference model's stacked expert weights
    `...experts.{gate,up,down}_proj.weight` (E, out, in) quantized to MXFP4 (`models.quant.quantize`,
    llama.cpp's rounding) and stored in OpenAI's layout (gate and up rows interleaved in
    `gate_up_proj_{blocks,scales}`); every other tensor passes through."""
    import torch

    from tandem.models.quant.quantize import quantize

    out, experts = {}, {}
    stacked = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate|up|down)_proj\.weight")
    for name, t in tensors.items():
        m = stacked.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {})[m.group(2)] = t
    for base, parts in experts.items():
        gate_up = torch.stack((parts["gate"], parts["up"]), dim=2)  # (E, I, 2, D)
        fused = {"gate_up_proj": gate_up.flatten(1, 2), "down_proj": parts["down"]}
        for proj, w in fused.items():
            blocks, scales = openai_from_ggml(quantize(w.float().numpy(), MXFP4))
            out[f"{base}{proj}_blocks"] = torch.from_numpy(blocks)
            out[f"{base}{proj}_scales"] = torch.from_numpy(scales)
    return out
