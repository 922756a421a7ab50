"""The wire dtype code table: the one place a byte on the wire is given a meaning.

A frame names its payload's element type by a one-byte code from this table; a receiver decodes the
payload as exactly that type (never as its own compute dtype), which is what keeps a float16 rank and
a bfloat16 rank from reinterpreting each other's 16-bit words (the paper's dtype hazard).
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownDtypeError(ValueError):
    """A dtype code or name that is not in the wire table."""


@dataclass(frozen=True)
class WireDtype:
    """One row of the table: a stable `code` on the wire, a `name`, the element size in bytes, and
    whether collectives may sum it (floats reduce in float32; integers only travel)."""

    code: int
    name: str
    itemsize: int
    reducible: bool


FLOAT32 = WireDtype(1, "float32", 4, True)
FLOAT16 = WireDtype(2, "float16", 2, True)
BFLOAT16 = WireDtype(3, "bfloat16", 2, True)
INT64 = WireDtype(4, "int64", 8, False)
INT32 = WireDtype(5, "int32", 4, False)
UINT8 = WireDtype(6, "uint8", 1, False)

TABLE: tuple[WireDtype, ...] = (FLOAT32, FLOAT16, BFLOAT16, INT64, INT32, UINT8)
_BY_CODE = {d.code: d for d in TABLE}
_BY_NAME = {d.name: d for d in TABLE}

# The dtypes a cluster may negotiate as its collective wire dtype (float32 is the canonical default).
NEGOTIABLE_WIRE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def by_code(code: int) -> WireDtype:
    """The table row for `code`; an unknown code raises UnknownDtypeError."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise UnknownDtypeError(
            f"unknown wire dtype code {code}; known codes: "
            + ", ".join(f"{d.code}={d.name}" for d in TABLE)
        ) from None


def by_name(name: str) -> WireDtype:
    """The table row for `name` (e.g. "float32"); an unknown name raises UnknownDtypeError."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownDtypeError(
            f"unknown wire dtype {name!r}; known: {', '.join(_BY_NAME)}"
        ) from None


def negotiable(name: str) -> WireDtype:
    """The row for a collective wire dtype; names outside NEGOTIABLE_WIRE_DTYPES are refused."""
    d = by_name(name)
    if d.name not in NEGOTIABLE_WIRE_DTYPES:
        raise UnknownDtypeError(
            f"wire dtype {name!r} cannot carry a reduction; choose one of "
            f"{', '.join(NEGOTIABLE_WIRE_DTYPES)}"
        )
    return d
