"""`GGUFModel`: a GGUF model (one file, a folder holding one, or split parts) as a model source,
the GGUF counterpart of `safetensors_dir.ModelDir`: `config`, `manifest` / `info` (keyed by the
model's HF parameter names), `blocks` (a quantized tensor in its blocks), `read` (a tensor as
dense values), `fingerprint`, `tokenizer`, `close`.

Split models `NAME-00001-of-0000N.gguf` are found from any part; each part must exist and say in
its `split.no` / `split.count` where it sits, and together they must hold `split.tensors.count`
tensors, none twice. Metadata is the first part's.

A fused projection (a phi3 file's `attn_qkv`, and its `ffn_up`: gate then up) is in the manifest
as its parts (`loaders.fused_rows`), each the byte range of its whole rows of blocks: a row slice
of a GGUF tensor is contiguous, so a part reads, shards and multiplies like any tensor and nothing
is dequantized or requantized.

Whole tensors are zero-copy views of the memory-mapped files (a TP shard's slices are read with
pread: `blocks`) except the q/k weights (and biases) of a
`llama` file, whose rows llama.cpp's converter permuted (`names.unpermute_rows`): those are read
with pread (so their pages never become this process's resident memory through the mapping) and
gathered back into HF order, one new contiguous copy per q and k matrix *in its blocks*, i.e.
`(n_heads + n_kv_heads) * head_dim * row_bytes(hidden)` bytes per layer of anonymous memory
(8.3 MB, 9%, of the 92 MB SmolLM2-135M Q4_1 file; about 8% of a Llama-3-8B Q4_K file), while the
rest of the file stays mapped. The torch-free path reads them as stored instead (`as_stored`,
`qk_pairs`: its RoPE rotates the file's pairs), with no copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tandem.loaders.errors import MissingTensorError, TensorShapeError
from tandem.loaders.fused_rows import check_rows, row_views, rules_for
from tandem.loaders.gguf.config import (
    GGUFArchitectureError,
    Metadata,
    architecture,
    config_from_gguf,
    family_of,
)
from tandem.loaders.gguf.names import ROPE_FREQS, gguf_name, hf_name, permuted_heads, unpermute_rows
from tandem.loaders.gguf.reader import (
    GGUFCorruptError,
    GGUFError,
    GGUFMissingFileError,
    GGUFTensorTypeError,
    GuardedReader,
    open_reader,
)
from tandem.models.quant.blocks import BY_ID, LAYOUTS, QUANTIZED
from tandem.models.quant.values import as_float32

if TYPE_CHECKING:
    import torch

    from tandem.loaders.tokenizer import Tokenizer

SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
PREAD_CHUNK = 4 << 20  # bytes of whole rows read at once for a column slice (then copied out)
FINGERPRINT_SAMPLE = 256  # bytes of each tensor's data folded into the fingerprint


class GGUFMissingTensorError(GGUFError, MissingTensorError):
    """The model needs a tensor no part of the GGUF file holds."""


class GGUFShapeError(GGUFError, TensorShapeError):
    """A tensor whose shape disagrees with the one the metadata implies."""


class GGUFSliceError(GGUFError, ValueError):
    """A slice read outside the tensor, or off its block (or head) boundaries."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    file: Path
    gguf_name: str
    type_id: int
    shape: tuple[int, ...]  # (rows, cols) as the model's parameter: GGUF's dims reversed;
    # an MoE layer's stacked experts (E, rows, cols): E matrices one after the other
    offset: int  # absolute byte offset in `file`
    nbytes: int
    part: int  # index of the reader holding it

    @property
    def dtype(self) -> str:
        """The ggml type's name ("Q4_K", "F32", ...)."""
        return BY_ID[self.type_id].name

    @property
    def quantized(self) -> bool:
        return self.type_id in QUANTIZED


def gguf_files(path: str | Path) -> list[Path]:
    """The file(s) of the GGUF model at `path`: a `.gguf` file (all parts of a split one, in
    order), or a folder holding exactly one GGUF model."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        firsts = [p for p in found if not SPLIT_NAME.fullmatch(p.name) or "-00001-of-" in p.name]
        if len(firsts) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise GGUFMissingFileError(
                f"{path}: a model folder must hold exactly one GGUF model (found: {names})"
            )
        path = firsts[0]
    if not path.is_file():
        raise GGUFMissingFileError(f"{path}: no such GGUF file")
    m = SPLIT_NAME.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [
        path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFMissingFileError(f"{path}: split part(s) {', '.join(missing)} not found")
    return parts


class GGUFModel:
    """An opened GGUF model: every part parsed and checked, config built; tensors read lazily."""

    def __init__(self, path: str | Path) -> None:
        self.files = gguf_files(path)
        self.path = self.files[0]
        self.readers: list[GuardedReader] = [open_reader(f) for f in self.files]
        self.metadata = Metadata(self.readers[0], self.path)
        architecture(self.metadata)  # an unsupported file is refused before its tensors are read
        self._raw: dict[str, GGUFTensorInfo] = {}  # GGUF name -> info
        for part, reader in enumerate(self.readers):
            self._check_split(part, reader)
            for t in reader.tensors:
                if t.name in self._raw:
                    raise GGUFCorruptError(
                        f"{self.files[part]}: tensor {t.name!r} also in {self._raw[t.name].file}"
                    )
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self._raw[t.name] = GGUFTensorInfo(
                    self.files[part],
                    t.name,
                    int(t.tensor_type),
                    shape,
                    t.data_offset,
                    int(t.n_bytes),
                    part,
                )
        self._check_split_total()
        self.family = family_of(self.metadata, self._raw.keys())
        self.arch = self.family.gguf_arch
        embed = self._raw.get("token_embd.weight")
        self.config = config_from_gguf(
            self.metadata,
            self._raw.keys(),
            embed.shape[0] if embed else None,
            self._rope_freqs(),
            self._config_values(),
        )
        self.manifest: dict[str, GGUFTensorInfo] = {}  # HF parameter name -> info
        for name, info in self._raw.items():
            hf = hf_name(name, self.family.gguf_names)
            if hf is not None:
                self.manifest[hf] = info
        self._fused = self._split_fused()
        self._check_no_stray_tensors()

    def _split_fused(self) -> set[str]:
        """Replaces each fused projection in the manifest by its parts' row ranges (module
        docstring); returns the fused HF names it consumed."""
        rules = rules_for(self.config)
        views = row_views(list(self.manifest), rules)
        for name, view in views.items():
            src = self.manifest[view.source]
            check_rows(view.source, src.shape[0], rules, f"{src.file}: {src.gguf_name}")
            row_bytes = src.nbytes // src.shape[0]
            a, b = view.row0, view.row0 + view.rows
            self.manifest[name] = replace(
                src,
                gguf_name=f"{src.gguf_name} rows [{a}, {b})",
                shape=(view.rows, *src.shape[1:]),
                offset=src.offset + a * row_bytes,
                nbytes=view.rows * row_bytes,
            )
        fused = {v.source for v in views.values()}
        for name in fused:
            del self.manifest[name]
        return fused

    def _config_values(self) -> dict[str, list[float]]:
        """The values of the family's `gguf_config_tensors` the file holds, by field (a phi3
        file's longrope factor sets)."""
        got = {}
        for field, name in self.family.gguf_config_tensors.items():
            info = self._raw.get(name)
            if info is not None:
                got[field] = self.values_array(info, name).reshape(-1).tolist()
        return got

    def _check_split(self, part: int, reader: GuardedReader) -> None:
        if len(self.files) == 1:
            return
        meta = Metadata(reader, self.files[part])
        no, count = meta.get("split.no", int), meta.get("split.count", int)
        if (no, count) != (part, len(self.files)):
            raise GGUFCorruptError(
                f"{self.files[part]}: says it is split part {no} of {count}, its name says "
                f"{part} of {len(self.files)} (counting from 0)"
            )

    def _check_split_total(self) -> None:
        if len(self.files) == 1:
            return
        want = self.metadata.get("split.tensors.count", int)
        if want != len(self._raw):
            raise GGUFCorruptError(
                f"{self.path}: split.tensors.count is {want} but the {len(self.files)} parts hold "
                f"{len(self._raw)} tensors"
            )

    def _check_no_stray_tensors(self) -> None:
        """Every tensor must feed a parameter of the model the config describes: one it has no
        place for (q/k norms in a llama file, an unknown name) means a variant tandem would
        silently run wrong."""
        used = self.config.checkpoint_names() | self._fused
        config_only = {ROPE_FREQS, *self.family.gguf_config_tensors.values()}
        stray = [
            i.gguf_name
            for name, i in self._raw.items()
            if name not in config_only and hf_name(name, self.family.gguf_names) not in used
        ]
        if stray:
            raise GGUFArchitectureError(
                f"{self.path}: tensor(s) {', '.join(repr(n) for n in stray[:5])} have no place in "
                f"a {self.arch} model tandem runs"
            )

    def _rope_freqs(self) -> list[float] | None:
        info = self._raw.get(ROPE_FREQS)
        if info is None:
            return None
        return self.values_array(info, ROPE_FREQS).reshape(-1).tolist()

    # ---- tensors --------------------------------------------------------------------------

    def info(self, name: str) -> GGUFTensorInfo:
        """The GGUF tensor behind model parameter `name` (an HF name)."""
        info = self.manifest.get(name)
        if info is None:
            raise GGUFMissingTensorError(
                f"{self.path}: no tensor {gguf_name(name, self.family.gguf_names)!r} (the model's {name!r})"
            )
        return info

    def check(self, name: str, shape: tuple[int, ...]) -> GGUFTensorInfo:
        """`info(name)`, after checking its type is one tandem reads and its shape is `shape`
        (a dense tensor stored without `shape`'s size-1 dims too: qwen35's conv (C, K) for the
        model's (C, 1, K); the caller reshapes what it reads)."""
        info = self.info(name)
        if info.type_id not in BY_ID:
            raise GGUFTensorTypeError(
                f"{info.file}: tensor {info.gguf_name!r} is of type "
                f"{_type_name(info.type_id)}; tandem reads {', '.join(t.name for t in LAYOUTS)}"
            )
        squeezed = tuple(d for d in shape if d != 1)  # llama.cpp's converter drops size-1 dims
        if info.shape != tuple(shape) and (info.quantized or info.shape != squeezed):
            raise GGUFShapeError(
                f"{info.file}: tensor {info.gguf_name!r} has shape {list(info.shape)}, the "
                f"metadata implies {list(shape)}"
            )
        return info

    def _bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The raw bytes of a tensor, zero-copy: uint8 (rows, row_bytes) ((E, rows, row_bytes)
        for stacked experts), or (nbytes,) for 1-D."""
        data = self.readers[info.part].data
        raw = np.asarray(data[info.offset : info.offset + info.nbytes])
        return raw if len(info.shape) == 1 else raw.reshape(*info.shape[:-1], -1)

    def _view(self, info: GGUFTensorInfo) -> torch.Tensor:
        """`_bytes` as a torch tensor (the same memory)."""
        import torch

        return torch.from_numpy(self._bytes(info))

    # ---- torch-free reads (the single-node CPU path that never imports torch) -------------

    @property
    def qk_pairs(self) -> bool:
        """Whether this file's q/k rows are stored in llama.cpp's RoPE pair order (a `llama`
        file, module docstring): what `as_stored` reads keep."""
        return self.family.permuted_qk

    def block_array(self, name: str, as_stored: bool = False) -> np.ndarray:
        """Parameter `name` as uint8 blocks (rows, row_bytes) as numpy: a view of the mapped file
        in HF row order, or an un-permuted copy for a llama q/k (module docstring). With
        `as_stored`, a view in the file's row order always (`qk_pairs` says which that is)."""
        info = self.info(name)
        heads = None if as_stored else self._heads(name)
        return self._bytes(info) if heads is None else unpermute_rows(_stored(info), heads)

    def values_array(
        self, info: GGUFTensorInfo | str, name: str | None = None, as_stored: bool = False
    ) -> np.ndarray:
        """A tensor (an HF parameter name or a raw info) as float32 values in HF row order (the
        file's with `as_stored`), as numpy (`models.quant.values.as_float32`: F32 a view, the rest
        widened or dequantized). For the small tensors (norms, biases, rope factors)."""
        heads = None
        if isinstance(info, str):
            name = info
            info, heads = self.info(name), None if as_stored else self._heads(name)
        self._check_type(info, name or info.gguf_name)
        raw = self._bytes(info) if heads is None else _stored(info)
        out = as_float32(raw.reshape(-1, raw.shape[-1]), info.type_id)
        out = out.reshape(info.shape)
        return out if heads is None else unpermute_rows(out, heads)

    def _heads(self, name: str) -> int | None:
        if not self.family.permuted_qk:
            return None
        c = self.config
        return permuted_heads(name, c.num_attention_heads, c.num_key_value_heads)

    def blocks(
        self,
        name: str,
        dim: int | None = None,
        start: int | None = None,
        end: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Quantized parameter `name` as uint8 blocks (rows, row_bytes), HF row order: a view
        of the mapped file, or an un-permuted copy for a llama q/k (module docstring).

        With `dim`, only the half-open slice `[start, end)` of that dimension (in elements):
            dim 0  rows: all of them, a zero-copy view of the mapped file; fewer, read with
                   pread (a copy of exactly those rows: a view would make the page-cache folios
                   across the slice's edges this process's resident pages, 1.5x the slice's
                   bytes measured with large folios); for a llama q/k the slice must be whole
                   heads, read and un-permuted
            dim 1  columns: `start` and `end` multiples of the type's block size; exactly those
                   bytes of every row, read with pread (not through the mapping, so the
                   tensor's other bytes never become this process's resident pages)
        Never the whole tensor: a shard reads only its own blocks.

        Stacked experts (E, rows, cols) take dim 0 (experts: whole matrices, one read), dim 1
        (rows of every expert) and dim 2 (columns of every row), returned as (E', rows', bytes');
        `experts` = (e0, e1) keeps only experts [e0, e1) of a dim 1 or 2 slice."""
        if experts is not None:
            info = self.info(name)
            if len(info.shape) != 3 or dim not in (1, 2):
                raise GGUFSliceError(
                    f"{info.gguf_name!r}: experts {experts} with slice dimension {dim} (1 or 2 "
                    "of stacked experts)"
                )
            return self._expert_blocks(info, dim, start, end, experts)
        if dim is None:
            import torch

            return torch.from_numpy(self.block_array(name))
        info = self.info(name)
        if len(info.shape) == 3:
            return self._expert_blocks(info, dim, start, end)
        raw = self._view(info)
        heads = self._heads(name)
        rows, cols = info.shape
        if dim == 0:
            self._check_range(info, start, end, rows, 1, "rows")
            if start == 0 and end == rows and heads is None:
                return raw
            rb = raw.shape[1]
            if heads is None:
                return _pread_rows(info, start, end, 0, rb)  # not through the mapping
            hd = rows // heads
            if start % hd or end % hd:
                raise GGUFSliceError(
                    f"{info.file}: rows [{start}, {end}) of {info.gguf_name!r} are not whole "
                    f"heads of {hd} (its rows are permuted per head)"
                )
            part = _pread_rows(info, start, end, 0, rb)  # not through the mapping: no page kept
            return unpermute_rows(part, (end - start) // hd)
        if dim == 1:
            t = BY_ID[info.type_id]
            self._check_range(info, start, end, cols, t.block_size, "columns")
            b0, b1 = start // t.block_size * t.block_bytes, end // t.block_size * t.block_bytes
            part = _pread_rows(info, 0, rows, b0, b1)  # (rows, (end - start) / bs * bb)
            return part if heads is None else unpermute_rows(part, heads)
        raise GGUFSliceError(f"{info.gguf_name!r}: slice dimension {dim} (0 or 1)")

    def _expert_blocks(
        self, info: GGUFTensorInfo, dim: int, start, end, experts: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """`blocks` of stacked experts (E, rows, cols): the matrices as one (E rows, cols) tensor;
        of a row or column slice only experts [e0, e1) where `experts` says so."""
        import torch

        e, rows, cols = info.shape
        e0, e1 = (0, e) if experts is None else experts
        self._check_range(info, e0, e1, e, 1, "experts")
        flat = replace(info, shape=(e * rows, cols))
        rb = info.nbytes // (e * rows)
        if dim == 0:
            self._check_range(info, start, end, e, 1, "experts")
            part = _pread_array(flat, start * rows, end * rows, 0, rb)
            return torch.from_numpy(part.reshape(end - start, rows, rb))
        if dim == 1:
            self._check_range(info, start, end, rows, 1, "rows")
            parts = [
                _pread_array(flat, x * rows + start, x * rows + end, 0, rb) for x in range(e0, e1)
            ]
            return torch.from_numpy(np.stack(parts))
        if dim == 2:
            t = BY_ID[info.type_id]
            self._check_range(info, start, end, cols, t.block_size, "columns")
            b0, b1 = start // t.block_size * t.block_bytes, end // t.block_size * t.block_bytes
            part = _pread_array(flat, e0 * rows, e1 * rows, b0, b1)
            return torch.from_numpy(part.reshape(e1 - e0, rows, -1))
        raise GGUFSliceError(f"{info.gguf_name!r}: slice dimension {dim} (0, 1 or 2)")

    @staticmethod
    def _check_range(info: GGUFTensorInfo, start, end, size: int, align: int, what: str) -> None:
        if start is None or end is None or not 0 <= start < end <= size:
            raise GGUFSliceError(
                f"{info.file}: {what} [{start}, {end}) outside {info.gguf_name!r}'s {size}"
            )
        if start % align or end % align:
            raise GGUFSliceError(
                f"{info.file}: {what} [{start}, {end}) of {info.gguf_name!r} ({info.dtype}) do "
                f"not fall on its {align}-element block boundaries"
            )

    @staticmethod
    def _check_type(info: GGUFTensorInfo, name: str) -> None:
        if info.type_id not in BY_ID:
            raise GGUFTensorTypeError(
                f"{info.file}: tensor {name!r} is of type {_type_name(info.type_id)}; tandem "
                f"reads {', '.join(t.name for t in LAYOUTS)}"
            )

    def _dense(self, info: GGUFTensorInfo, name: str, pread: bool = False) -> torch.Tensor:
        """The tensor as values: a view of the mapping (16/32-bit) or dequantized; `pread`: from
        a copy read with pread instead of the mapping."""
        import torch

        from tandem.models.quant.dequant import dequantize

        self._check_type(info, name)
        raw = torch.from_numpy(_stored(info)) if pread else self._view(info)
        kind = BY_ID[info.type_id].name
        if kind in ("F32", "F16", "BF16"):
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
            return raw.reshape(-1).view(dtype).view(info.shape)
        return dequantize(raw.reshape(-1, raw.shape[-1]), info.type_id).view(info.shape)

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int | None = None,
        end: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Parameter `name` as values, HF row order: F32/F16/BF16 as stored (a view unless
        un-permuted), a quantized tensor dequantized to float32 (a new tensor). With `dim`, the
        slice `[start, end)` of that dimension only (a quantized one: its blocks, dequantized);
        `experts` = (e0, e1): of stacked experts only those (`blocks`)."""
        info = self.info(name)
        if experts is not None and not info.quantized:
            e0, e1 = experts
            self._check_range(info, e0, e1, info.shape[0], 1, "experts")
            return self.read(name, dim, start, end)[e0:e1]
        if dim is not None and info.quantized:
            from tandem.models.quant.dequant import dequantize

            b = self.blocks(name, dim, start, end, experts)
            cols = b.shape[-1] // BY_ID[info.type_id].block_bytes * BY_ID[info.type_id].block_size
            return dequantize(b.reshape(-1, b.shape[-1]), info.type_id).view(*b.shape[:-1], cols)
        heads = self._heads(name)
        if dim is None:  # a whole permuted q/k: read with pread, then un-permuted (one copy kept)
            t = self._dense(info, info.gguf_name, pread=heads is not None)
            return t if heads is None else unpermute_rows(t, heads)
        t = self._dense(info, info.gguf_name)
        self._check_range(info, start, end, info.shape[dim], 1, "elements")
        part = t.narrow(dim, start, end - start)
        if heads is None:
            return part
        if dim == 1:
            return unpermute_rows(part, heads)
        hd = info.shape[0] // heads
        if start % hd or end % hd:
            raise GGUFSliceError(f"{info.file}: rows [{start}, {end}) are not whole heads of {hd}")
        return unpermute_rows(part, (end - start) // hd)

    # ---- identity and companions ----------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 over the config (rope frequency factors included), the manifest (names, types,
        shapes, offsets), each part's size and header bytes (all metadata, the tokenizer
        included), and the first bytes of every tensor: ranks holding different files, or the
        same model quantized differently, disagree."""
        h = hashlib.sha256(json.dumps(self.config.to_hf_dict(), sort_keys=True).encode())
        h.update(repr(self.config.rope_freq_factors).encode())
        for file, reader in zip(self.files, self.readers):
            h.update(f"{file.name}|{len(reader.data)}\n".encode())
            h.update(memoryview(reader.data[: reader.data_offset]))
        for name in sorted(self._raw):
            i = self._raw[name]
            h.update(f"{name}|{i.type_id}|{list(i.shape)}|{i.part}|{i.offset}\n".encode())
            sample = self.readers[i.part].data[
                i.offset : i.offset + min(i.nbytes, FINGERPRINT_SAMPLE)
            ]
            h.update(memoryview(sample))
        return h.hexdigest()

    def weight_format(self) -> str:
        """How the weights are stored, for reports: "GGUF Q4_1/Q8_0/F32" (the types holding the
        most bytes first)."""
        size: dict[str, int] = {}
        for info in self._raw.values():
            size[info.dtype] = size.get(info.dtype, 0) + info.nbytes
        return "GGUF " + "/".join(sorted(size, key=lambda d: -size[d]))

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer and chat template from the file's metadata (`gguf.tokenizer`), or None
        for a file that carries no tokenizer (prompts must then be token ids)."""
        if "tokenizer.ggml.model" not in self.metadata:
            return None
        from tandem.loaders.gguf.tokenizer import load_gguf_tokenizer  # tokenizers + jinja2: 10 MB

        return load_gguf_tokenizer(self.readers[0], self.path)

    def close(self) -> None:
        """Drops this object's references to the mappings; tensors already handed out keep
        theirs alive."""
        self.readers = []


def _stored(info: GGUFTensorInfo) -> np.ndarray:
    """A whole tensor's bytes as stored, uint8 (rows, row_bytes) (a 1-D tensor: one element a
    row), read with pread."""
    return _pread_array(info, 0, info.shape[0], 0, info.nbytes // info.shape[0])


def _pread_rows(info: GGUFTensorInfo, r0: int, r1: int, b0: int, b1: int) -> torch.Tensor:
    """`_pread_array` as a torch tensor (the same memory)."""
    import torch

    return torch.from_numpy(_pread_array(info, r0, r1, b0, b1))


def _pread_array(info: GGUFTensorInfo, r0: int, r1: int, b0: int, b1: int) -> np.ndarray:
    """Bytes `[b0, b1)` of rows `[r0, r1)` of a 2-D tensor, read with pread into a new uint8
    (r1 - r0, b1 - b0) array: none of the tensor's pages become this process's resident memory
    (a copy through the mapping would keep every page of every row it crosses mapped and
    resident). A column slice reads whole rows PREAD_CHUNK bytes at a time into one reused
    buffer and keeps the slice: one system call per chunk, not per row (an MoE down_exps tensor
    has E x D rows)."""
    rb = info.nbytes // info.shape[0]
    out = np.empty((r1 - r0, b1 - b0), dtype=np.uint8)
    with open(info.file, "rb", buffering=0) as f:
        fd = f.fileno()
        if b0 == 0 and b1 == rb:  # whole rows: one contiguous read
            n = os.preadv(fd, [out], info.offset + r0 * rb)
            if n != out.nbytes:
                raise GGUFCorruptError(f"{info.file}: short read of {info.gguf_name!r}")
        else:  # whole rows in chunks through a bounce buffer, then the columns kept
            step = max(1, PREAD_CHUNK // rb)
            bounce = np.empty((min(step, r1 - r0), rb), dtype=np.uint8)
            for i in range(0, r1 - r0, step):
                buf = bounce[: min(step, r1 - r0 - i)]
                n = os.preadv(fd, [buf], info.offset + (r0 + i) * rb)
                if n != buf.nbytes:
                    raise GGUFCorruptError(f"{info.file}: short read of {info.gguf_name!r}")
                out[i : i + len(buf)] = buf[:, b0:b1]
    return out


def _type_name(type_id: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return f"{GGMLQuantizationType(type_id).name} (id {type_id})"
    except ValueError:
        return f"id {type_id}"
