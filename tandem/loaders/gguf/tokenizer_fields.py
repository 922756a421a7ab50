"""Typed, bounded reads of a GGUF's tokenizer metadata, and the errors a bad field raises.

Every read checks the field's GGUF value type and its size before `ReaderField.contents()` turns it
into Python objects, so a hostile file gets a typed error naming the file and the key instead of a
wrong-typed value, a `UnicodeDecodeError` or a list of 2^31 strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from tandem.loaders.errors import ModelFileError

V = gguf.GGUFValueType
_INT_TYPES = frozenset((V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64))
_FLOAT_TYPES = frozenset((V.FLOAT32, V.FLOAT64))
MAX_STRING_BYTES = 1 << 16


class GGUFTokenizerError(ModelFileError):
    """The GGUF's tokenizer metadata cannot be turned into a tokenizer."""


class UnknownTokenizerError(GGUFTokenizerError):
    """`tokenizer.ggml.model` or `tokenizer.ggml.pre` names something tandem does not build."""


class MissingTokenizerFieldError(GGUFTokenizerError):
    """A key the tokenizer needs (tokens, merges, scores, the model name) is absent."""


class TokenizerFieldError(GGUFTokenizerError):
    """A key has the wrong type or a value that cannot be right (an id outside the vocabulary, a
    duplicate token, a merge of tokens that do not exist, bytes that are not UTF-8)."""


class TokenizerLengthError(GGUFTokenizerError):
    """Arrays that describe the same tokens have different lengths, or the vocabulary is empty."""


class TokenizerSizeError(GGUFTokenizerError):
    """A count or a string length past any real tokenizer's."""


class Metadata:
    """The file's key/value fields, read with the type and size each key must have."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def _field(self, key: str, required: bool) -> Any:
        field = self.fields.get(key)
        if field is None and required:
            raise MissingTokenizerFieldError(f"{self.path}: no {key} in the metadata")
        return field

    def _wrong(self, key: str, field: Any, want: str) -> TokenizerFieldError:
        got = "[" + ", ".join(t.name for t in field.types) + "]"
        return TokenizerFieldError(f"{self.path}: {key} is {got}, expected {want}")

    def _contents(self, key: str, field: Any, max_bytes: int) -> Any:
        """`field.contents()` once every string in it is known to be at most `max_bytes` long."""
        if field.types[-1] == V.STRING:
            parts = [field.parts[-1]] if field.types[0] == V.STRING else field.parts
            idxs = [0] if field.types[0] == V.STRING else field.data
            longest = max((parts[i].nbytes for i in idxs), default=0)
            if longest > max_bytes:
                raise TokenizerSizeError(
                    f"{self.path}: {key} holds a string of {longest} bytes (at most {max_bytes})"
                )
        try:
            return field.contents()
        except UnicodeDecodeError as e:
            raise TokenizerFieldError(f"{self.path}: {key} is not UTF-8 ({e})") from e

    def string(
        self, key: str, *, required: bool = False, max_bytes: int = MAX_STRING_BYTES
    ) -> str | None:
        field = self._field(key, required)
        if field is None:
            return None
        if field.types != [V.STRING]:
            raise self._wrong(key, field, "a string")
        return self._contents(key, field, max_bytes)

    def _array(self, key: str, required: bool, limit: int, length: int | None) -> Any:
        field = self._field(key, required)
        if field is None:
            return None
        if not field.types or field.types[0] != V.ARRAY or len(field.types) > 2:
            raise self._wrong(key, field, "an array")
        count = len(field.data)
        if count > limit:
            raise TokenizerSizeError(f"{self.path}: {key} has {count} entries (at most {limit})")
        if length is not None and count != length:
            raise TokenizerLengthError(
                f"{self.path}: {key} has {count} entries, the vocabulary {length}"
            )
        return field

    def strings(
        self, key: str, *, required: bool = False, limit: int, max_bytes: int
    ) -> list[str] | None:
        field = self._array(key, required, limit, None)
        if field is None:
            return None
        if not field.data:
            return []
        if field.types[-1] != V.STRING:
            raise self._wrong(key, field, "an array of strings")
        return self._contents(key, field, max_bytes)

    def _numbers(self, key: str, required: bool, length: int, kinds: frozenset, want: str) -> Any:
        field = self._array(key, required, 1 << 62, length)
        if field is None:
            return None
        if not field.data:
            return []
        if field.types[-1] not in kinds:
            raise self._wrong(key, field, want)
        return field.contents()

    def ints(self, key: str, *, length: int, required: bool = False) -> list[int] | None:
        return self._numbers(key, required, length, _INT_TYPES, "an array of integers")

    def floats(self, key: str, *, length: int, required: bool = False) -> list[float] | None:
        # llama.cpp takes INT32 scores too
        kinds = _FLOAT_TYPES | {V.INT32}
        out = self._numbers(key, required, length, kinds, "an array of numbers")
        return None if out is None else [float(x) for x in out]

    def bool(self, key: str, *, default: bool) -> bool:
        field = self._field(key, False)
        if field is None:
            return default
        if field.types != [V.BOOL]:
            raise self._wrong(key, field, "a bool")
        return bool(field.contents())

    def token_id(self, key: str, n_tokens: int, *, default: int | None) -> int | None:
        """The id under `key` (checked to lie in `[0, n_tokens)`), or `default` when absent."""
        field = self._field(key, False)
        if field is None:
            return default
        if len(field.types) != 1 or field.types[0] not in _INT_TYPES:
            raise self._wrong(key, field, "an integer")
        value = int(field.contents())
        if not 0 <= value < n_tokens:
            raise TokenizerFieldError(
                f"{self.path}: {key} = {value} is outside the vocabulary of {n_tokens} tokens"
            )
        return value
