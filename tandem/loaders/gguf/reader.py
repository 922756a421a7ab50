"""Opening one GGUF file with gguf-py's `GGUFReader`, guarded so a hostile file costs bounded
memory and ends in a typed error naming the file (and the tensor).

The parsing is gguf-py's own (pinned in requirements.lock). `GGUFReader` trusts the counts and
lengths it reads: a kv count or array length of 2^63 loops (and allocates) until the end of the
file or forever, a string length past the end yields a short view, `np.prod` of hostile dims
wraps. `GuardedReader` wraps the reader's private primitives (`_get`, `_get_str`,
`_get_field_parts`, `_build_fields`, `_build_tensor_info`, `_build_tensors`) with checks made
*before* each read or loop:

    every read lies inside the file                       else past-the-end (truncated)
    kv count <= MAX_KV, tensor count <= MAX_TENSORS, and each count times its smallest entry fits
    in the bytes left; one array <= MAX_ARRAY_LEN elements, all arrays <= MAX_ARRAY_ELEMENTS
    (gguf-py keeps one numpy view per element); a string <= MAX_STRING_BYTES
    a tensor: <= 4 dims, a type id that exists, whole blocks per row, offset aligned, its bytes
    inside the file (products in Python ints, never wrapped), and no two tensors' bytes overlap
    (a model whose q and k read the same bytes loads and says nonsense)

`_get` also hands out one plain ndarray per read instead of gguf-py's chain of `np.memmap` views,
and a metadata array of strings or scalars (a vocabulary's tokens, merges, scores, types) keeps no
view per element at all: `_build_fields` gives it an `_ArrayParts`, gguf-py's parts list made on
access from one int64 offset per element, so `ReaderField.contents()` and every index still work.
gguf-py's own parse keeps ~4 Python objects per element: for a 152k-token vocabulary (the
`qwen3-0.6b` preset) about 65 MB on every rank that opens the file, where this keeps 2.4 MB.

The file is mapped copy-on-write (`mode="c"`): tensors are zero-copy, writable-typed views of the
page cache (torch takes them without a copy or a warning), and nothing is ever written back.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderField
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tandem.loaders.errors import (
    CorruptFileError,
    MissingFileError,
    ModelFileError,
    TensorDtypeError,
)

MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY_LEN = 1 << 24
MAX_ARRAY_ELEMENTS = 1 << 23  # a 256k vocabulary's tokens, scores, types and merges: ~1M
MAX_STRING_BYTES = 1 << 24
MAX_DIMS = 4
HEADER_BYTES = 24  # magic, version, tensor count, kv count
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_DTYPES: dict[tuple[Any, str], np.dtype] = {}  # (dtype, byte order) -> dtype, made once
_SCALAR_BYTES = {t: np.dtype(n).itemsize for t, n in GGUFReader.gguf_scalar_to_np.items()}


class GGUFError(ModelFileError):
    """Base of every error about a GGUF file; the message names the file (and the tensor)."""


class GGUFCorruptError(GGUFError, CorruptFileError):
    """Bytes that are not a GGUF file: bad magic or version, truncated, absurd counts or lengths,
    a tensor past the end."""


class GGUFMissingFileError(GGUFError, MissingFileError):
    """A GGUF file (or a part of a split model) that is absent or unreadable."""


class GGUFTensorTypeError(GGUFError, TensorDtypeError):
    """A tensor type id that does not exist, or that tandem does not read."""


class GGUFOverlapError(GGUFCorruptError):
    """Two tensors whose data ranges share bytes; the message names both and their ranges."""


class _Refused(Exception):
    """Raised inside the reader's parse; `open_reader` turns it into GGUFCorruptError."""


class _ArrayParts(Sequence):
    """The parts gguf-py lays out for an array field, made on access: `prefix` (the key's parts,
    the item type, the count), then per element a string's (length, bytes) or a scalar's value.
    `starts[i]` is element i's byte offset; a string's length is read again from the file."""

    def __init__(self, reader: GuardedReader, prefix: list, starts: np.ndarray, item: int) -> None:
        self._reader, self._prefix, self._starts = reader, prefix, starts
        self._string = item == GGUFValueType.STRING
        self._per = 2 if self._string else 1
        self._np = None if self._string else GGUFReader.gguf_scalar_to_np[GGUFValueType(item)]

    def data_indices(self) -> range:
        """The indices of the elements' values (a string's bytes, a scalar)."""
        n, first = len(self._starts), len(self._prefix) + self._per - 1
        return range(first, first + self._per * n, self._per)

    def __len__(self) -> int:
        return len(self._prefix) + self._per * len(self._starts)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = k + len(self) if k < 0 else k
        if not 0 <= k < len(self):
            raise IndexError(k)
        if k < len(self._prefix):
            return self._prefix[k]
        i, j = divmod(k - len(self._prefix), self._per)
        at = int(self._starts[i])
        if not self._string:
            return self._reader._get(at, self._np)
        length = self._reader._get(at, np.uint64)
        return length if j == 0 else self._reader._get(at + 8, np.uint8, int(length[0]))


class GuardedReader(GGUFReader):
    """`GGUFReader` whose every read and loop is bounded first (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._elements = 0
        super().__init__(path, mode="c")

    def _left(self, offset: int) -> int:
        return len(self.data) - int(offset)

    def _get(self, offset, dtype, count=1, override_order=None):
        """gguf-py's `_get`, bounds-checked, as one plain ndarray over the mapping: the reader
        keeps a view per metadata element (~250k for a 49k-token vocabulary), and its own
        slice-view-view chain of `np.memmap`s costs ~1 KB each where this costs ~100 bytes."""
        count, offset = int(count), int(offset)
        n = np.dtype(dtype).itemsize * count
        if count < 0 or offset < 0 or n > self._left(offset):
            raise _Refused(
                f"a read of {n} bytes at byte {offset} runs past the end of the file "
                f"({len(self.data)} bytes; truncated?)"
            )
        plain = self._plain_view()
        order = self.byte_order if override_order is None else override_order
        kind = _DTYPES.get((dtype, order))
        if kind is None:
            kind = _DTYPES[dtype, order] = np.dtype(dtype).newbyteorder(order)
        return np.ndarray((count,), dtype=kind, buffer=plain, offset=offset)  # one view, no chain

    def _get_str(self, offset):
        (n,) = self._get(offset, np.uint64)
        if int(n) > MAX_STRING_BYTES:
            raise _Refused(
                f"a string at byte {offset} claims {int(n)} bytes (at most {MAX_STRING_BYTES})"
            )
        return super()._get_str(offset)

    def _get_field_parts(self, orig_offs, raw_type):
        if int(raw_type) == GGUFValueType.ARRAY:
            (item,) = self._get(orig_offs, np.uint32)
            self._check_array(int(orig_offs), int(item))
        return super()._get_field_parts(orig_offs, raw_type)

    def _check_array(self, offs: int, item: int) -> int:
        """The element count of the array at `offs` once it is known to fit (module docstring)."""
        (count,) = self._get(offs + 4, np.uint64)
        count = int(count)
        smallest = _SCALAR_BYTES.get(item, 12 if item == GGUFValueType.ARRAY else 8)
        self._elements += count
        left = self._left(offs + 12)
        why = None
        if count > MAX_ARRAY_LEN or self._elements > MAX_ARRAY_ELEMENTS:
            why = f"at most {MAX_ARRAY_LEN}, and {MAX_ARRAY_ELEMENTS} in all arrays"
        elif count * smallest > left:
            why = f"the {left} bytes left hold at most {left // smallest} (truncated?)"
        if why:
            raise _Refused(f"an array at byte {offs} claims {count} elements; {why}")
        return count

    def _build_fields(self, offs, count):
        """gguf-py's `_build_fields`, with arrays of strings or scalars as `_ArrayParts`."""
        self._check_count("metadata key/value", int(count), MAX_KV, _MIN_KV_BYTES, offs)
        for _ in range(int(count)):
            start = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            prefix = [klen, kdata, raw_type]
            name = str(bytes(kdata), encoding="utf-8")
            array = self._flat_array(offs, int(raw_type[0]), prefix)
            if array is not None:
                size, parts, types = array
                field = ReaderField(start, name, parts, parts.data_indices(), types)
            else:
                size, more, idxs, types = self._get_field_parts(offs, raw_type[0])
                field = ReaderField(start, name, prefix + more, [i + 3 for i in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _flat_array(self, offs: int, raw_type: int, prefix: list):
        """(bytes, `_ArrayParts`, types) of an array of strings or scalars at `offs`, or None for
        any other field (gguf-py's parse takes it). Every element is bounds-checked here."""
        if raw_type != GGUFValueType.ARRAY:
            return None
        (item,) = self._get(offs, np.uint32)
        item = int(item)
        if item != GGUFValueType.STRING and item not in _SCALAR_BYTES:
            return None
        count = self._check_array(offs, item)
        raw_itype, alen = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
        first = offs + 12
        if item == GGUFValueType.STRING:
            starts = np.empty(count, dtype=np.int64)
            buf, end, at = self._plain_view(), len(self.data), first
            for i in range(count):
                if at + 8 > end:
                    raise _Refused(f"a string at byte {at} runs past the end of the file")
                (n,) = struct.unpack_from("<Q", buf, at)
                if n > MAX_STRING_BYTES or at + 8 + n > end:
                    raise _Refused(
                        f"a string at byte {at} claims {n} bytes (at most {MAX_STRING_BYTES}, "
                        f"and inside the file's {end})"
                    )
                starts[i] = at
                at += 8 + n
            size = at - offs
        else:
            width = _SCALAR_BYTES[item]
            starts = first + width * np.arange(count, dtype=np.int64)
            size = 12 + width * count
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(item)] if count else [])
        return size, _ArrayParts(self, prefix + [raw_itype, alen], starts, item), types

    def _plain_view(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _build_tensor_info(self, offs, count):
        self._check_count("tensor", int(count), MAX_TENSORS, _MIN_TENSOR_INFO_BYTES, offs)
        return super()._build_tensor_info(offs, count)

    def _check_count(self, what: str, count: int, most: int, smallest: int, offs: int) -> None:
        if count > most or count * smallest > self._left(offs):
            raise _Refused(
                f"the header claims {count} {what} entries; at most {most}, and the "
                f"{self._left(offs)} bytes left hold at most {self._left(offs) // smallest}"
            )

    def _build_tensors(self, start_offs, fields):
        spans = [self._check_tensor(int(start_offs), field) for field in fields]
        self._check_disjoint(spans)
        return super()._build_tensors(start_offs, fields)

    def _check_disjoint(self, spans: list[tuple[int, int, str]]) -> None:
        """No byte of the data section belongs to two tensors ([begin, end) each; empty ones
        hold nothing)."""
        last: tuple[int, int, str] | None = None  # the span reaching furthest so far
        for begin, end, name in sorted(s for s in spans if s[1] > s[0]):
            if last is not None and begin < last[1]:
                raise GGUFOverlapError(
                    f"{self.path}: tensors {last[2]!r} (bytes [{last[0]}, {last[1]})) and "
                    f"{name!r} (bytes [{begin}, {end})) overlap"
                )
            if last is None or end > last[1]:
                last = (begin, end, name)

    def _check_tensor(self, start: int, field: Any) -> tuple[int, int, str]:
        """The tensor's (begin, end, name) in the file, once its info is known sound."""
        _, name_data, n_dims, dims, raw_type, offset = field.parts
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Refused(f"a tensor name at byte {field.offset} is not UTF-8") from e
        if int(n_dims[0]) > MAX_DIMS:
            raise _Refused(f"tensor {name!r} has {int(n_dims[0])} dims (at most {MAX_DIMS})")
        try:
            kind = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise GGUFTensorTypeError(
                f"{self.path}: tensor {name!r} has type id {int(raw_type[0])}, which does not "
                "exist in ggml"
            ) from None
        shape = [int(d) for d in dims]
        block, size = GGML_QUANT_SIZES[kind]
        if shape and shape[0] % block:
            raise _Refused(
                f"tensor {name!r} rows of {shape[0]} elements are not whole {kind.name} blocks "
                f"of {block}"
            )
        n = 1
        for d in shape:
            n *= d
        nbytes, rel = n // block * size, int(offset[0])
        if rel % self.alignment:
            raise _Refused(f"tensor {name!r} offset {rel} is not a multiple of {self.alignment}")
        if start + rel + nbytes > len(self.data):
            raise _Refused(
                f"tensor {name!r} ({kind.name}, dims {shape}) spans bytes [{start + rel}, "
                f"{start + rel + nbytes}) but the file has {len(self.data)} (offset past the end, "
                "or truncated)"
            )
        return start + rel, start + rel + nbytes, name


def open_reader(path: Path) -> GuardedReader:
    """One GGUF file, parsed and bounds-checked; GGUFError subclasses for anything wrong."""
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise GGUFMissingFileError(f"{path}: cannot read ({e.strerror or e})") from e
    if size < HEADER_BYTES:
        raise GGUFCorruptError(f"{path}: {size} bytes, too short for a GGUF header")
    try:
        reader = GuardedReader(path)
    except GGUFError:
        raise
    except _Refused as e:
        raise GGUFCorruptError(f"{path}: {e}") from None
    except OSError as e:
        raise GGUFMissingFileError(f"{path}: cannot read ({e.strerror or e})") from e
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as e:
        raise GGUFCorruptError(f"{path}: not a GGUF file tandem can read ({e})") from None
    if reader.byte_order != "I":
        raise GGUFCorruptError(f"{path}: a big-endian GGUF file; tandem reads little-endian only")
    return reader
