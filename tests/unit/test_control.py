import pytest
import torch

from tandem.engine.executor import Step, StepSequence
from tandem.engine.tp import control
from tandem.engine.tp.control import Control, ControlError


def _roundtrip(msg):
    frame, extra = control.encode(msg)
    assert frame.shape == (control.FRAME,) and frame.dtype == torch.int64
    assert control.payload_len(frame) == (0 if extra is None else extra.numel())
    return control.decode(frame, extra)


def test_decode_step_fits_in_one_frame_and_roundtrips():
    step = Step((StepSequence(7, (42,), 12), StepSequence(2**40, (151935,), 0)))
    msg = Control(control.KIND_STEP, step, release=(3, 5))
    frame, extra = control.encode(msg)
    assert extra is None
    assert control.decode(frame) == msg


def test_long_prefill_uses_a_second_tensor_and_roundtrips():
    step = Step((StepSequence(1, tuple(range(100)), 0), StepSequence(9, (5, 6, 7), 40)))
    msg = Control(control.KIND_STEP, step)
    assert _roundtrip(msg) == msg


def test_release_and_stop_roundtrip():
    assert _roundtrip(Control(control.KIND_RELEASE, None, (1, 2))) == Control(
        control.KIND_RELEASE, None, (1, 2)
    )
    assert _roundtrip(Control(control.KIND_STOP)) == Control(control.KIND_STOP)


def test_wrong_magic_is_refused():
    frame, _ = control.encode(Control(control.KIND_STOP))
    frame[0] = 1
    with pytest.raises(ControlError, match="magic"):
        control.decode(frame)


def test_inconsistent_counts_are_refused():
    frame, _ = control.encode(Control(control.KIND_STEP, Step((StepSequence(1, (4, 5), 0),))))
    bad = frame.clone()
    bad[3] = 5  # n_tokens
    with pytest.raises(ControlError):
        control.decode(bad)
    bad = frame.clone()
    bad[1] = 99
    with pytest.raises(ControlError, match="kind"):
        control.decode(bad)


def test_truncated_payload_is_refused():
    frame, extra = control.encode(
        Control(control.KIND_STEP, Step((StepSequence(1, tuple(range(80)), 0),)))
    )
    with pytest.raises(ControlError, match="truncated"):
        control.decode(frame, extra[:-1])


def test_greedy_flag_roundtrips_and_unknown_flags_are_refused():
    step = Step((StepSequence(4, (9,), 12), StepSequence(5, (1,), 3)), greedy=True)
    frame, extra = control.encode(Control(control.KIND_STEP, step))
    assert control.decode(frame, extra).step == step
    plain = Step(step.sequences)
    assert control.decode(*control.encode(Control(control.KIND_STEP, plain))).step.greedy is False
    frame[6] = 6  # a flag this version does not know
    with pytest.raises(control.ControlError, match="flags"):
        control.decode(frame, extra)


def test_a_copy_frame_carries_the_releases_then_src_dst_n_and_roundtrips():
    msg = Control(control.KIND_COPY, None, (4, 6), (3, 9, 1000))
    frame, extra = control.encode(msg)
    assert extra is None and frame[8:13].tolist() == [4, 6, 3, 9, 1000]
    assert control.decode(frame) == msg
    many = Control(control.KIND_COPY, None, tuple(range(70)), (0, 2**40, 5))
    assert _roundtrip(many) == many  # releases past the inline room: a second tensor


def test_a_copy_frame_that_is_malformed_is_refused():
    with pytest.raises(ControlError, match="only a COPY"):
        control.encode(Control(control.KIND_RELEASE, None, (), (1, 2, 3)))
    with pytest.raises(ControlError, match="only a COPY"):
        control.encode(Control(control.KIND_COPY))
    for bad in [(1, 1, 5), (1, 2, 0), (-1, 2, 5)]:
        frame, _ = control.encode(Control(control.KIND_COPY, None, (), (1, 2, 5)))
        frame[8:11] = torch.tensor(bad)
        with pytest.raises(ControlError, match="copy"):
            control.decode(frame)
    frame, _ = control.encode(Control(control.KIND_COPY, None, (), (1, 2, 5)))
    frame[5] = 2  # a payload too short for (src, dst, n)
    with pytest.raises(ControlError, match="counts"):
        control.decode(frame)
