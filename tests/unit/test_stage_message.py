"""Stage frames: exact round trips, explicit dtype conversion at the seam, hostile frames refused."""

import struct

import pytest
import torch

from tandem.engine.pp import frames as pp
from tandem.engine.pp.frames import (
    LocalStageTransport,
    StageLinkError,
    StageMessage,
    StageMessageError,
)


def forward_msg(dtype=torch.float32, lengths=(3, 1)):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(len(lengths), max(lengths), 8, generator=g).to(dtype)
    return StageMessage(
        pp.KIND_FORWARD, 7, (11, -2)[: len(lengths)], (0, 5)[: len(lengths)], lengths, h
    )


def test_forward_frame_round_trips_exactly_in_f32():
    msg = forward_msg()
    out = pp.decode(pp.encode(msg))
    assert (out.kind, out.tag, out.seq_ids, out.start_pos, out.lengths) == (
        1,
        7,
        (11, -2),
        (0, 5),
        (3, 1),
    )
    assert out.hidden.dtype == torch.float32 and torch.equal(out.hidden, msg.hidden)


def test_frame_is_header_metadata_and_exactly_the_hidden_bytes():
    msg = forward_msg()
    frame = pp.encode(msg)
    assert len(frame) == 24 + 2 * 16 + 3 * 4 + msg.hidden.numel() * 4
    assert frame[:4] == b"TDPP"


def test_bf16_compute_over_f32_wire_decodes_into_the_receivers_f16():
    msg = forward_msg(torch.bfloat16)
    out = pp.decode(pp.encode(msg, "float32"), wire_dtype="float32", dtype=torch.float16)
    assert out.hidden.dtype == torch.float16
    torch.testing.assert_close(out.hidden, msg.hidden.float().half(), atol=0, rtol=0)


def test_bf16_wire_halves_the_payload_and_is_decoded_as_bf16_not_reinterpreted():
    msg = forward_msg(torch.float32)
    f32, bf16 = pp.encode(msg, "float32"), pp.encode(msg, "bfloat16")
    assert len(f32) - len(bf16) == msg.hidden.numel() * 2
    out = pp.decode(bf16, wire_dtype="bfloat16", dtype=torch.float32)
    torch.testing.assert_close(out.hidden, msg.hidden.bfloat16().float(), atol=0, rtol=0)


def test_a_frame_in_another_wire_dtype_than_agreed_fails_closed():
    with pytest.raises(StageMessageError, match="agreed wire dtype is float32"):
        pp.decode(pp.encode(forward_msg(), "float16"), wire_dtype="float32")


def test_control_frames_round_trip():
    rel = StageMessage(pp.KIND_RELEASE, 0, (3, 4), (0, 0), (0, 0))
    assert pp.decode(pp.encode(rel)) == rel
    err = pp.decode(pp.encode(StageMessage(pp.KIND_ERROR, text="stage 2: boom")))
    assert err.kind == pp.KIND_ERROR and err.text == "stage 2: boom"
    assert pp.decode(pp.encode(StageMessage(pp.KIND_STOP))).kind == pp.KIND_STOP


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda f: b"XXXX" + f[4:], "bad magic"),
        (lambda f: f[:4] + b"\x09" + f[5:], "version 9"),
        (lambda f: f[:5] + b"\x63" + f[6:], "unknown stage message kind"),
        (lambda f: f[:10], "shorter than its header"),
        (lambda f: f[:-4], "payload of"),
        (lambda f: f + b"\0\0\0\0", "payload of"),
        (lambda f: f[:6] + struct.pack("<H", 99) + f[8:], "unknown wire dtype code 99"),
        (lambda f: f[:8] + struct.pack("<I", 1 << 30) + f[12:], "claims"),
        (lambda f: f[:8] + struct.pack("<I", 900) + f[12:], "truncated inside"),
    ],
)
def test_hostile_frames_are_refused_before_any_tensor_is_built(mutate, msg):
    frame = pp.encode(forward_msg())
    with pytest.raises((StageMessageError, ValueError), match=msg):
        pp.decode(mutate(frame))


def test_hidden_shape_must_fit_the_sequence_table():
    bad = StageMessage(pp.KIND_FORWARD, 0, (1,), (0,), (2,), torch.zeros(1, 3, 4))
    with pytest.raises(StageMessageError, match="does not fit"):
        pp.decode(pp.encode(bad))


def test_local_transport_delivers_the_same_bytes_in_order_and_times_out():
    a, b = LocalStageTransport.pair()
    frames = [pp.encode(forward_msg()), pp.encode(StageMessage(pp.KIND_STOP))]
    for f in frames:
        a.send(f)
    assert [b.recv(1.0) for _ in frames] == frames
    assert a.bytes_sent == b.bytes_received == sum(map(len, frames))
    with pytest.raises(StageLinkError, match="no stage frame within"):
        b.recv(0.05)
    a.close()
    with pytest.raises(StageLinkError, match="closed by its peer"):
        b.recv(1.0)


def test_a_copy_frame_round_trips_and_a_malformed_one_is_refused():
    msg = StageMessage(pp.KIND_COPY, seq_ids=(3, 9), start_pos=(0, 0), lengths=(40, 40))
    assert pp.decode(pp.encode(msg)) == msg
    for ids, lengths in [((3, 3), (40, 40)), ((3, 9), (40, 41)), ((3, 9), (0, 0)), ((3,), (4,))]:
        bad = StageMessage(pp.KIND_COPY, seq_ids=ids, start_pos=(0,) * len(ids), lengths=lengths)
        with pytest.raises(StageMessageError, match="copy"):
            pp.decode(pp.encode(bad))
