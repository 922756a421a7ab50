"""A Hugging Face model directory: `config.json` plus `model.safetensors` or a sharded
`model.safetensors.index.json`.

Every file's header is parsed and checked against the file size before anything is read, so a
truncated file or a header that claims more bytes than exist is refused up front. Tensors are read
through memory-mapped `safe_open` handles, one at a time and only the slice asked for, so a
tensor-parallel rank reads only its shard and no second full copy of the checkpoint is made.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from tandem.config import ModelConfig
from tandem.loaders.errors import (  # noqa: F401  (re-exported: where callers have found them)
    CorruptFileError,
    MissingFileError,
    MissingTensorError,
    ModelFileError,
    TensorDtypeError,
    TensorShapeError,
)
from tandem.loaders.expert_tensors import View, expert_views, is_expert_source, router_alias
from tandem.loaders.fused_rows import RowSlice, check_rows, row_views, rules_for

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype code -> (torch dtype name, bytes per element)
ELEMENT_TYPES: dict[str, tuple[str, int]] = {
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


@cache
def torch_dtypes() -> dict[str, tuple[torch.dtype, int]]:
    """safetensors dtype code -> (torch dtype, bytes per element); imports torch."""
    import torch

    return {code: (getattr(torch, name), n) for code, (name, n) in ELEMENT_TYPES.items()}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # built on first access, so reading headers needs no torch
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FLOAT_CODES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ELEMENT_TYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parses and checks one safetensors file's header against the file's real size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError(f"{file}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CorruptFileError(
                    f"{file}: header claims {n} bytes but the file has only {size - 8} after the length"
                )
            raw = f.read(n)
    except OSError as e:
        raise MissingFileError(f"{file}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # deep nesting: RecursionError
        raise CorruptFileError(f"{file}: header is not a JSON object ({e})") from e
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (a, b) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(x, int) and x >= 0 for x in (*shape, a, b)):
                raise TypeError
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptFileError(f"{file}: tensor {name!r} has a malformed header entry") from e
        if code not in ELEMENT_TYPES:
            raise TensorDtypeError(f"{file}: tensor {name!r} has unknown dtype {code!r}")
        info = TensorInfo(file, code, shape)
        if b < a or b - a != info.nbytes:
            raise CorruptFileError(
                f"{file}: tensor {name!r} spans bytes [{a}, {b}) but {code}{list(shape)} needs {info.nbytes}"
            )
        if b > data_size:
            raise CorruptFileError(
                f"{file}: tensor {name!r} ends at byte {b} of the data but the file holds only "
                f"{data_size} (truncated?)"
            )
        out[name] = info
    return out


class ModelDir:
    """An opened model directory. `config` is parsed, every header checked; tensors are read lazily.

    `manifest` is keyed by the reference model's names: a mixture-of-experts checkpoint's
    per-expert (or fused) tensors appear as the stacked (E, out, in) tensors the model holds, and
    Mixtral's router under `mlp.gate` (`expert_tensors`), and a fused projection (Phi-3's
    `qkv_proj`, `gate_up_proj`) as its parts (`fused_rows`); `sources` keeps the files' own names."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingFileError(f"{self.path}: not a directory")
        self.config = ModelConfig.from_dir(self.path)
        self.manifest: dict[str, TensorInfo] = {}
        for file in self._weight_files():
            for name, info in read_header(file).items():
                if name in self.manifest:
                    raise CorruptFileError(
                        f"{file}: tensor {name!r} also in {self.manifest[name].file}"
                    )
                self.manifest[name] = info
        self.sources = dict(self.manifest)
        # reference name -> source name: tensors the family stores under other names (a
        # multimodal checkpoint's text weights: Gemma 3's)
        self._renames: dict[str, str] = self.config.family.checkpoint_renames(self.manifest)
        for name, source in self._renames.items():
            self.manifest[name] = self.manifest.pop(source)
        self._views = self._expert_views()
        self._rows = self._row_views()
        self._handles: dict[Path, Any] = {}

    def _row_views(self) -> dict[str, RowSlice]:
        """Replaces each fused projection in the manifest by its parts (`fused_rows`)."""
        rules = rules_for(self.config)
        views = row_views(self.sources, rules)
        for name, view in views.items():
            src = self.sources[view.source]
            check_rows(view.source, src.shape[0], rules, str(src.file))
            self.manifest.pop(view.source, None)
            self.manifest[name] = TensorInfo(src.file, src.dtype, (view.rows, *src.shape[1:]))
        return views

    def _expert_views(self) -> dict[str, View]:
        """Renames Mixtral's routers and replaces the expert sources by their stacked views."""
        views = expert_views(self.sources, self.config.architecture)
        for name in list(self.manifest):
            alias = router_alias(name)
            if alias is not None:
                self.manifest[alias] = self.manifest.pop(name)
                self._renames[alias] = name
            elif is_expert_source(name):
                del self.manifest[name]
        for name, view in list(views.items()):
            if view.layout != "rows":  # gpt-oss (`View`)
                src = self.sources[view.fused]
                half = 1 if view.layout == "t" else 2
                shape = (src.shape[0], src.shape[-1] // half)  # (E, out)
                if view.layout != "b2":
                    shape += (src.shape[1],)  # (E, out, in)
                self.manifest[name] = TensorInfo(src.file, src.dtype, shape)
                continue
            if view.fused is not None:
                src = self.sources[view.fused]
                e, rows, cols = src.shape
                out = rows // 2 if name.endswith(("gate_proj.weight", "up_proj.weight")) else rows
                if view.row0 == -1:
                    view = views[name] = View((), view.fused, out)
                self.manifest[name] = TensorInfo(src.file, src.dtype, (e, out, cols))
                continue
            first = self.sources[view.parts[0]]
            for part in view.parts:
                info = self.sources[part]
                if (info.dtype, info.shape) != (first.dtype, first.shape):
                    raise TensorShapeError(
                        f"{info.file}: expert tensor {part!r} is {info.dtype}{list(info.shape)}, "
                        f"{view.parts[0]!r} is {first.dtype}{list(first.shape)}"
                    )
            self.manifest[name] = TensorInfo(
                first.file, first.dtype, (len(view.parts), *first.shape)
            )
        return views

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({str(v) for v in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CorruptFileError(f"{index}: not a valid safetensors index ({e})") from e
            for f in files:
                if Path(f).name != f:
                    raise CorruptFileError(f"{index}: shard name {f!r} must be a plain file name")
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise MissingFileError(
                    f"{index}: shard(s) {', '.join(missing)} not found in {self.path}"
                )
            return [self.path / f for f in files]
        single = self.path / SINGLE_FILE
        if not single.is_file():
            raise MissingFileError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        return [single]

    def info(self, name: str) -> TensorInfo:
        info = self.manifest.get(name)
        if info is None:
            raise MissingTensorError(f"{self.path}: no file holds tensor {name!r}")
        return info

    def read(
        self,
        name: str,
        dim: int | None = None,
        start: int | None = None,
        end: int | None = None,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Tensor `name`, or its slice [start, end) along `dim`, in its stored dtype on the CPU;
        `experts`: of stacked experts (E, ...) only experts [e0, e1) (dim 0), with any slice."""
        info = self.info(name)
        if experts is not None:
            return self._read_experts(name, info, dim, start, end, experts)
        rows = self._rows.get(name)
        if rows is not None:  # a part of a fused projection: only its rows of the source
            index = list(self._index(info.shape, dim, start, end))
            if dim is not None and not (
                0 <= dim < len(info.shape)
                and 0 <= index[dim].start <= index[dim].stop <= info.shape[dim]
            ):
                raise TensorShapeError(
                    f"{info.file}: slice [{start}, {end}) of dim {dim} outside {name!r} {info.shape}"
                )
            r = index[0]
            index[0] = slice(rows.row0 + r.start, rows.row0 + r.stop)
            return self.read_source(rows.source, tuple(index))
        view = self._views.get(name)
        if view is not None or name in self._renames:
            if dim is not None:
                lo, hi = start or 0, info.shape[dim] if end is None else end
                if not (0 <= dim < len(info.shape) and 0 <= lo <= hi <= info.shape[dim]):
                    raise TensorShapeError(
                        f"{info.file}: slice [{lo}, {hi}) of dim {dim} outside {name!r} {info.shape}"
                    )
                start, end = lo, hi
            if view is None:  # a renamed tensor
                return self.read_source(
                    self._renames[name], self._index(info.shape, dim, start, end)
                )
            return view.read(self.read_source, info.shape, dim, start, end)
        handle = self._handles.get(info.file)
        try:
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            if dim is None:
                return handle.get_tensor(name)
            if not 0 <= dim < len(info.shape):
                raise TensorShapeError(
                    f"{info.file}: tensor {name!r} has no dim {dim} (shape {info.shape})"
                )
            lo, hi = start or 0, info.shape[dim] if end is None else end
            if not 0 <= lo <= hi <= info.shape[dim]:
                raise TensorShapeError(
                    f"{info.file}: slice [{lo}, {hi}) of dim {dim} outside tensor {name!r} {info.shape}"
                )
            index = tuple(
                slice(lo, hi) if d == dim else slice(None) for d in range(len(info.shape))
            )
            return handle.get_slice(name)[index]
        except SafetensorError as e:
            raise CorruptFileError(f"{info.file}: reading tensor {name!r} failed ({e})") from e

    def _read_experts(self, name: str, info, dim, start, end, experts) -> torch.Tensor:
        """`read` of experts [e0, e1) of a stacked (E, ...) tensor, sliced along `dim` (1 or 2;
        None: whole): reads only those experts' bytes of the slice."""
        e0, e1 = experts
        if len(info.shape) < 2 or not 0 <= e0 < e1 <= info.shape[0] or dim == 0:
            raise TensorShapeError(
                f"{info.file}: experts [{e0}, {e1}) with dim {dim} of {name!r} {info.shape}"
            )
        index = list(self._index(info.shape, dim, start, end))
        if dim is not None and not 0 <= index[dim].start <= index[dim].stop <= info.shape[dim]:
            raise TensorShapeError(
                f"{info.file}: slice [{start}, {end}) of dim {dim} outside {name!r} {info.shape}"
            )
        index[0] = slice(e0, e1)
        view = self._views.get(name)
        if view is not None:
            return view.read_index(self.read_source, tuple(index))
        return self.read_source(self._renames.get(name, name), tuple(index))

    @staticmethod
    def _index(shape: tuple[int, ...], dim: int | None, start, end) -> tuple[slice, ...]:
        def part(d: int, n: int) -> slice:
            if d != dim:
                return slice(0, n)
            return slice(0 if start is None else start, n if end is None else end)

        return tuple(part(d, n) for d, n in enumerate(shape))

    def read_source(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """`index` (one slice per dimension) of source tensor `name` (the file's own name, a key
        of `sources`), reading only those bytes."""
        info = self.sources[name]
        handle = self._handles.get(info.file)
        try:
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            return handle.get_slice(name)[index]
        except SafetensorError as e:
            raise CorruptFileError(f"{info.file}: reading tensor {name!r} failed ({e})") from e

    def fingerprint(self) -> str:
        """sha256 over the config and the tensor manifest (names, dtypes, shapes): ranks whose
        fingerprints differ hold different models."""
        h = hashlib.sha256(json.dumps(self.config.to_hf_dict(), sort_keys=True).encode())
        for name in sorted(self.manifest):
            info = self.manifest[name]
            h.update(f"{name}|{info.dtype}|{list(info.shape)}\n".encode())
        return h.hexdigest()

    def tokenizer(self):
        """The directory's `tokenizer.json` tokenizer, or None without one."""
        from tandem.loaders.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path)

    def weight_format(self) -> str:
        """How the weights are stored, for reports: "safetensors BF16" (several dtypes: the one
        holding the most bytes first, "safetensors BF16/F32")."""
        size: dict[str, int] = {}
        for info in self.manifest.values():
            size[info.dtype] = size.get(info.dtype, 0) + info.nbytes
        return "safetensors " + "/".join(sorted(size, key=lambda d: -size[d]))

    def close(self) -> None:
        self._handles.clear()
