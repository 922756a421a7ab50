"""Properties of the frame parser over generated input (Hypothesis): every header round-trips;
arbitrary or mutated bytes are either a valid header or a typed FrameError, never another
exception; and a channel fed arbitrary bytes raises only typed protocol errors, allocating no
more than the receiver's bound however large the frames claim to be."""

from __future__ import annotations

import math
import socket
import struct
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.transport.channel import Channel, UnexpectedFrameError
from tandem.transport.handshake import Identity
from tandem.transport.socketio import TimedSocket, TransportError
from tandem.wire import dtypes
from tandem.wire import frame as fr

U64 = st.integers(0, (1 << 64) - 1)
CODES = st.sampled_from([d.code for d in dtypes.TABLE])
# shapes whose byte count fits the header's 64-bit length field
SHAPES = st.one_of(
    st.lists(st.integers(0, 127), max_size=fr.MAX_NDIM),
    st.lists(st.integers(0, 1 << 20), max_size=3),
).map(tuple)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse(raw: bytes, max_bytes: int = 1 << 20) -> fr.FrameHeader:
    header, ndim = fr.decode_fixed(raw[: fr.FIXED_SIZE])
    header = fr.decode_shape(header, raw[fr.FIXED_SIZE : fr.FIXED_SIZE + 8 * ndim])
    fr.check_length(header, max_bytes)
    return header


@SETTINGS
@given(
    kind=st.sampled_from(sorted(fr.KINDS)),
    op=st.sampled_from(sorted(fr.OPS)),
    code=CODES,
    seq=U64,
    fp=U64,
    shape=SHAPES,
    step=st.integers(0, 0xFFFF),
)
def test_every_header_round_trips_and_its_length_is_prod_shape_times_itemsize(
    kind, op, code, seq, fp, shape, step
) -> None:
    raw = fr.encode_header(kind, op, code, seq, fp, shape, step)
    nbytes = math.prod(shape) * dtypes.by_code(code).itemsize
    h = _parse(raw, max_bytes=1 << 62)
    assert (h.kind, h.op, h.dtype, h.seq, h.fingerprint, h.shape, h.step) == (
        kind, op, code, seq, fp, shape, step,
    )  # fmt: skip
    assert h.payload_len == nbytes and len(raw) == fr.FIXED_SIZE + 8 * len(shape)


@SETTINGS
@given(st.binary(min_size=0, max_size=fr.FIXED_SIZE + 8 * fr.MAX_NDIM + 8))
def test_arbitrary_bytes_are_a_header_or_a_typed_frame_error(raw: bytes) -> None:
    try:
        h = _parse(raw)
    except fr.FrameError:
        return
    assert h.payload_len <= 1 << 20 and raw.startswith(fr.MAGIC)


@SETTINGS
@given(
    shape=SHAPES,
    code=CODES,
    at=st.integers(0, fr.FIXED_SIZE + 8 * fr.MAX_NDIM - 1),
    byte=st.integers(0, 255),
)
def test_a_valid_header_with_any_byte_changed_still_parses_or_fails_typed(
    shape, code, at, byte
) -> None:
    raw = bytearray(fr.encode_header(fr.DATA, fr.ALL_REDUCE, code, 1, 2, shape))
    if at < len(raw):
        raw[at] = byte
    try:
        h = _parse(bytes(raw), max_bytes=1 << 62)
    except fr.FrameError:
        return
    assert h.payload_len == math.prod(h.shape) * dtypes.by_code(h.dtype).itemsize


@settings(max_examples=60, deadline=None)
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=128),  # noise
            st.builds(  # a well-formed header claiming up to 2^64 - 1 bytes, no payload
                lambda kind, op, code, plen, dims: (
                    fr.FIXED.pack(fr.MAGIC, 1, kind, op, code, len(dims), 0, 0, 1, 0, plen)
                    + b"".join(struct.pack("<Q", d) for d in dims)
                ),
                st.sampled_from(sorted(fr.KINDS)),
                st.sampled_from(sorted(fr.OPS)),
                CODES,
                U64,
                st.lists(U64, max_size=fr.MAX_NDIM),
            ),
        ),
        max_size=6,
    )
)
def test_a_channel_fed_arbitrary_frames_raises_only_typed_errors_and_allocates_little(
    frames,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    a.sendall(b"".join(frames))
    a.close()  # then end of stream: the peer closed
    me, peer = Identity("c", 0, 2), Identity("c", 1, 2)
    ch = Channel(TimedSocket(b, "fuzz", timeout=2.0), me, peer, max_frame_bytes=1 << 16)
    tracemalloc.start()
    try:
        for _ in range(8):
            try:
                ch.recv_array(op=fr.P2P)
            except UnexpectedFrameError:
                continue  # well formed, not the awaited one: the caller decides
            except (fr.FrameError, TransportError):
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        ch.close()
    assert peak < (1 << 16) + (256 << 10)
