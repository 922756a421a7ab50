"""The wire format: golden header bytes, round trips, and every malformed header refused by type."""

from __future__ import annotations

import struct

import pytest

from tandem.wire import dtypes
from tandem.wire import frame as fr


def test_frame_header_golden_bytes() -> None:
    head = fr.encode_header(fr.DATA, fr.ALL_REDUCE, dtypes.FLOAT32.code, 7, 0xABCD, (2, 3), step=1)
    assert head == (
        b"TNDM"
        + struct.pack("<HBBBBHIQQQ", 1, 4, 1, 1, 2, 1, 0, 7, 0xABCD, 24)
        + struct.pack("<QQ", 2, 3)
    )
    assert fr.FIXED_SIZE == 40 and len(head) == 56


def test_seq_offset_is_where_the_header_keeps_its_seq() -> None:
    # the same-host path rewrites only this word of a header it wrote before
    head = fr.encode_header(fr.DATA, fr.ALL_REDUCE, 1, 0x0123456789ABCDEF, 77, (5,))
    assert struct.unpack_from("<Q", head, fr.SEQ_OFFSET)[0] == 0x0123456789ABCDEF
    assert fr.SEQ_OFFSET % 8 == 0


def test_frame_header_round_trips() -> None:
    head = fr.encode_header(fr.DATA, fr.P2P, dtypes.BFLOAT16.code, 2**40, 5, (4, 1, 9), step=3)
    h, ndim = fr.decode_fixed(head[: fr.FIXED_SIZE])
    h = fr.decode_shape(h, head[fr.FIXED_SIZE :])
    assert (h.op, h.dtype, h.seq, h.fingerprint, h.shape, h.step, ndim) == (
        fr.P2P, dtypes.BFLOAT16.code, 2**40, 5, (4, 1, 9), 3, 3,
    )  # fmt: skip
    assert fr.check_length(h, 1 << 20) == 4 * 9 * 2


def test_dtype_table_codes_are_stable_and_unique() -> None:
    assert [(d.code, d.name, d.itemsize) for d in dtypes.TABLE[:3]] == [
        (1, "float32", 4), (2, "float16", 2), (3, "bfloat16", 2),
    ]  # fmt: skip
    assert len({d.code for d in dtypes.TABLE}) == len(dtypes.TABLE)
    with pytest.raises(dtypes.UnknownDtypeError, match="99"):
        dtypes.by_code(99)
    with pytest.raises(dtypes.UnknownDtypeError, match="int64"):
        dtypes.negotiable("int64")


def _fixed(**kw: int) -> bytes:
    f = dict(
        magic=b"TNDM", version=1, kind=4, op=1, dtype=1, ndim=1, step=0, res=0, seq=1, fp=0, plen=4
    )
    f.update(kw)
    return fr.FIXED.pack(*f.values())


def test_foreign_bytes_are_refused_as_bad_magic() -> None:
    with pytest.raises(fr.BadMagicError):
        fr.decode_fixed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(fr.FIXED_SIZE, b"\0"))


def test_other_protocol_version_is_refused_naming_both() -> None:
    with pytest.raises(fr.VersionMismatchError, match="version 2.*version 1"):
        fr.decode_fixed(_fixed(version=2))


@pytest.mark.parametrize(
    "field", [dict(kind=99), dict(op=200), dict(res=1), dict(ndim=9), dict(dtype=77)]
)
def test_malformed_header_fields_are_refused(field: dict) -> None:
    with pytest.raises(fr.FrameFormatError):
        fr.decode_fixed(_fixed(**field))


def test_length_is_checked_against_shape_and_bound_before_allocation() -> None:
    h, _ = fr.decode_fixed(_fixed(plen=100 << 30))
    h = fr.decode_shape(h, struct.pack("<Q", 25 << 30))
    with pytest.raises(fr.FrameTooLargeError, match="107374182400"):
        fr.check_length(h, 1 << 30)
    h, _ = fr.decode_fixed(_fixed(plen=12))
    with pytest.raises(fr.FrameLengthError, match="12 payload bytes"):
        fr.check_length(fr.decode_shape(h, struct.pack("<Q", 4)), 1 << 30)


def test_fingerprint_separates_op_dtype_and_shape() -> None:
    base = fr.fingerprint(fr.ALL_REDUCE, 1, (4, 8))
    assert base == fr.fingerprint(fr.ALL_REDUCE, 1, (4, 8))
    others = [fr.fingerprint(fr.ALL_GATHER, 1, (4, 8)), fr.fingerprint(fr.ALL_REDUCE, 3, (4, 8)),
              fr.fingerprint(fr.ALL_REDUCE, 1, (8, 4)), fr.fingerprint(fr.ALL_REDUCE, 1, (32,))]  # fmt: skip
    assert base not in others
