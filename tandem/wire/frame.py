"""The frame: a fixed little-endian header, the payload's shape, then raw payload bytes.

    offset size field
    0      4    magic        b"TNDM"
    4      2    version      PROTOCOL_VERSION; a different version is refused, naming both
    6      1    kind         HELLO | AUTH | VERDICT | DATA | BEAT (a heartbeat: header only)
    7      1    op           the collective (or P2P / HANDSHAKE) this frame belongs to
    8      1    dtype        payload element type, a code of `dtypes.TABLE`
    9      1    ndim         number of shape dims that follow the header (<= MAX_NDIM)
    10     2    step         the algorithm step / chunk index inside the op
    12     4    reserved     zero
    16     8    seq          the op's sequence number on this channel
    24     8    fingerprint  digest of the op's logical (op, dtype, shape): catches shape desync
    32     8    payload_len  bytes of payload that follow the shape
    40     8*ndim shape      the payload's own shape; payload_len must equal prod(shape) * itemsize

A receiver reads the header, checks magic, version, kind, ndim, dtype code, and that payload_len
equals what the shape allows and stays under its bound (`check_length`), all before it allocates
anything for the payload. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from tandem.wire import dtypes

MAGIC = b"TNDM"
PROTOCOL_VERSION = 1
MAX_NDIM = 8

FIXED = struct.Struct("<4sHBBBBHIQQQ")
FIXED_SIZE = FIXED.size  # 40
# the seq field's byte offset (FIXED ends with seq, fingerprint and length, 8 bytes each)
SEQ_OFFSET = FIXED_SIZE - 24
_DIM = struct.Struct("<Q")

# kinds
HELLO, AUTH, VERDICT, DATA, BEAT = 1, 2, 3, 4, 5
# BEAT: a heartbeat, header only (no shape, no payload), on a link's own heartbeat connection
KINDS = {HELLO: "HELLO", AUTH: "AUTH", VERDICT: "VERDICT", DATA: "DATA", BEAT: "BEAT"}

# ops
HANDSHAKE, ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, BARRIER, P2P = range(8)
OPS = {
    HANDSHAKE: "handshake",
    ALL_REDUCE: "all_reduce_sum",
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_TO_ALL: "all_to_all",
    BROADCAST: "broadcast",
    BARRIER: "barrier",
    P2P: "p2p",
}


class FrameError(ValueError):
    """Base of every malformed or unexpected frame."""


class BadMagicError(FrameError):
    """The first bytes are not a tandem frame (a stray client, random bytes, another protocol)."""


class VersionMismatchError(FrameError):
    """The peer speaks another protocol version."""


class FrameFormatError(FrameError):
    """A header field outside its domain: unknown kind or op, too many dims, nonzero reserved."""


class FrameLengthError(FrameError):
    """payload_len disagrees with what the shape and dtype allow."""


class FrameTooLargeError(FrameError):
    """A frame larger than the receiver's bound (checked before any allocation)."""


@dataclass(frozen=True)
class FrameHeader:
    kind: int
    op: int
    dtype: int
    seq: int
    fingerprint: int
    payload_len: int
    shape: tuple[int, ...]
    step: int = 0
    version: int = PROTOCOL_VERSION

    def describe(self) -> str:
        return (
            f"{KINDS.get(self.kind, self.kind)} {OPS.get(self.op, self.op)} #{self.seq} "
            f"step {self.step} dtype {self.dtype} shape {self.shape} ({self.payload_len} bytes)"
        )


def fingerprint(op: int, dtype_code: int, shape: tuple[int, ...]) -> int:
    """A 64-bit digest of an op's logical identity; ranks at the same step must agree on it."""
    raw = struct.pack(f"<BB{len(shape)}Q", op, dtype_code, *shape)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def encode_header(
    kind: int,
    op: int,
    dtype_code: int,
    seq: int,
    fp: int,
    shape: tuple[int, ...],
    step: int = 0,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """The header and shape of a frame whose payload is `shape` elements of `dtype_code`."""
    if len(shape) > MAX_NDIM:
        raise FrameFormatError(f"a frame carries at most {MAX_NDIM} dims, got shape {shape}")
    nbytes = math.prod(shape) * dtypes.by_code(dtype_code).itemsize
    try:
        dims = b"".join(_DIM.pack(d) for d in shape)
    except struct.error as e:  # a dim outside its width (negative, 2^64, ...)
        raise FrameFormatError(f"cannot encode this header: {e}") from None
    return pack_header(kind, op, dtype_code, len(shape), step, seq, fp, nbytes, dims, version)


def pack_header(
    kind: int,
    op: int,
    dtype_code: int,
    ndim: int,
    step: int,
    seq: int,
    fp: int,
    payload_len: int,
    dims: bytes = b"",
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """The one writer of the header layout above, from fields already checked: `encode_header`
    derives and checks them from a shape; a sender of many frames of one shape (the ring's hops)
    keeps a shape's checked `ndim`, `payload_len` and packed `dims` and calls this directly."""
    try:
        head = FIXED.pack(MAGIC, version, kind, op, dtype_code, ndim, step, 0, seq, fp, payload_len)
    except struct.error as e:  # a field outside its width (a negative dim, a 2^64 seq, ...)
        raise FrameFormatError(f"cannot encode this header: {e}") from None
    return head + dims


def decode_fixed(buf: bytes | bytearray | memoryview) -> tuple[FrameHeader, int]:
    """The fixed 40 bytes -> (header with an empty shape, ndim); refuses foreign or malformed input."""
    if len(buf) != FIXED_SIZE:
        raise FrameFormatError(f"a fixed header is {FIXED_SIZE} bytes, got {len(buf)}")
    magic, version, kind, op, dtype, ndim, step, reserved, seq, fp, plen = FIXED.unpack(buf)
    if magic != MAGIC:
        raise BadMagicError(f"not a tandem frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"protocol version mismatch: peer speaks version {version}, "
            f"this rank speaks version {PROTOCOL_VERSION}"
        )
    if kind not in KINDS or op not in OPS or reserved != 0:
        raise FrameFormatError(f"malformed header: kind {kind}, op {op}, reserved {reserved}")
    if ndim > MAX_NDIM:
        raise FrameFormatError(f"frame claims {ndim} dims; at most {MAX_NDIM} are allowed")
    try:
        dtypes.by_code(dtype)
    except dtypes.UnknownDtypeError as e:
        raise FrameFormatError(str(e)) from None
    return FrameHeader(kind, op, dtype, seq, fp, plen, (), step, version), ndim


def decode_shape(header: FrameHeader, buf: bytes | bytearray | memoryview) -> FrameHeader:
    """Attach the `ndim` dims in `buf` to `header`."""
    if len(buf) % _DIM.size or len(buf) > MAX_NDIM * _DIM.size:
        raise FrameFormatError(f"{len(buf)} bytes are not a frame's shape (8 per dim, <= 8 dims)")
    ndim = len(buf) // _DIM.size
    shape = struct.unpack(f"<{ndim}Q", buf)
    return FrameHeader(
        header.kind, header.op, header.dtype, header.seq, header.fingerprint,
        header.payload_len, shape, header.step, header.version,
    )  # fmt: skip


def check_length(header: FrameHeader, max_bytes: int) -> int:
    """The payload size, once it is proven to equal prod(shape) * itemsize and to be <= max_bytes."""
    allowed = math.prod(header.shape) * dtypes.by_code(header.dtype).itemsize
    if header.payload_len > max_bytes or allowed > max_bytes:
        raise FrameTooLargeError(
            f"frame claims {max(header.payload_len, allowed)} bytes ({header.describe()}); "
            f"this receiver accepts at most {max_bytes}"
        )
    if header.payload_len != allowed:
        raise FrameLengthError(
            f"frame claims {header.payload_len} payload bytes but shape {header.shape} of dtype "
            f"{dtypes.by_code(header.dtype).name} is {allowed} bytes"
        )
    return allowed
