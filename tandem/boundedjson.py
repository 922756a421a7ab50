"""JSON from untrusted bytes with its size and nesting bounded before the parser runs.

`json.loads` recurses once per nested `[` or `{`; a few KB of brackets exhaust the interpreter's
recursion limit and raise RecursionError, which no caller expects from a parser. `loads` measures
the nesting first (brackets outside string literals, one pass in C through `re`), refuses more
than `max_depth` levels or more than `max_bytes` bytes, and turns every failure of the parser
(RecursionError and MemoryError included) into one typed error:

    obj = loads(raw, max_bytes=4096, max_depth=8)     # BoundedJSONError on anything else
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

DEFAULT_MAX_DEPTH = 64

# a complete string literal (escapes included), or one bracket
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class BoundedJSONError(ValueError):
    """Bytes that are not JSON, or JSON larger or deeper than the caller allows."""


def nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of `raw`, brackets inside string literals not counted."""
    steps = (_STEP[m[0]] for m in _TOKENS.findall(raw) if len(m) == 1)
    return max(accumulate(steps, initial=0))


def loads(raw: bytes | bytearray | str, *, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH):
    """The decoded JSON value of `raw`; BoundedJSONError if it is malformed, over `max_bytes`
    bytes or nested deeper than `max_depth`."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise BoundedJSONError(f"JSON of {len(data)} bytes exceeds the limit of {max_bytes}")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise BoundedJSONError(f"JSON nested {depth} levels deep; at most {max_depth} allowed")
    try:
        return json.loads(data)
    except (ValueError, RecursionError, MemoryError) as e:
        raise BoundedJSONError(f"not valid JSON ({type(e).__name__}: {e})") from None
