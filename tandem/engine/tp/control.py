"""Control messages from the head to the workers, as flat int64 tensors (no pickle, ever).

A message is a fixed frame of `FRAME` int64 values:

    [MAGIC, kind, n_seqs, n_tokens, n_release, payload_len, flags, 0 | inline payload ...]

followed, only when the payload does not fit inline (`payload_len > FRAME - HEADER`), by a second
tensor of exactly `payload_len` values. The payload is

    [seq_id, start_pos, n_tok] * n_seqs  ++  token ids (n_tokens, in sequence order)  ++  release ids
        ++  [src_seq, dst_seq, n]            a COPY only

so a decode step for a handful of sequences is one small fixed-size broadcast (`send_control` on
the head, `recv_control` on every worker). `flags` bit 0 is
the step's `greedy` (the ranks return argmax ids, not logits). Receivers check the magic, kind,
flags and every count against the frame before using them (`ControlError` otherwise).

A COPY (`KIND_COPY`, a prefix cache's copy: `TPExecutor.copy_prefix`) is one such frame of 3 +
n_release values: every rank frees `release` first (as before a step), then copies the first n
positions of its own shard of `src_seq`'s KV cache (its kv heads of every layer it holds) into
the new sequence `dst_seq`, which takes the lowest free slot on every rank alike. No tensor
crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.comm.base import Communicator
from tandem.engine.executor import Step, StepSequence

MAGIC = 0x54414E44454D  # "TANDEM"
FRAME = 64
HEADER = 8

KIND_STEP = 1  # run a forward over `step` (after freeing `release`)
KIND_RELEASE = 2  # only free the KV caches of `release`
KIND_STOP = 3  # leave the worker loop
KIND_PING = 4  # nothing to do: keeps an idle group's sockets inside their op timeout
KIND_STATS = 5  # every rank all-gathers its compute clock (`tp.balance`)
KIND_COPY = 6  # copy a sequence's first n cached positions into a new one (after `release`)
KINDS = (KIND_STEP, KIND_RELEASE, KIND_STOP, KIND_PING, KIND_STATS, KIND_COPY)
COPY_LEN = 3  # src_seq, dst_seq, n

FLAG_GREEDY = 1


class ControlError(RuntimeError):
    """A control frame is malformed or desynchronized (wrong magic, kind or counts)."""


@dataclass(frozen=True)
class Control:
    kind: int
    step: Step | None = None
    release: tuple[int, ...] = ()
    copy: tuple[int, int, int] | None = None  # (src_seq, dst_seq, n) of a KIND_COPY


def encode(msg: Control) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed frame (FRAME,) int64 and, when the payload is long, the payload (payload_len,)."""
    seqs = msg.step.sequences if msg.step is not None else ()
    payload: list[int] = []
    for s in seqs:
        payload += [s.seq_id, s.start_pos, len(s.token_ids)]
    n_tokens = 0
    for s in seqs:
        payload += s.token_ids
        n_tokens += len(s.token_ids)
    payload += msg.release
    if (msg.kind == KIND_COPY) != (msg.copy is not None):
        raise ControlError("a COPY frame, and only a COPY frame, carries (src, dst, n)")
    if msg.copy is not None:
        payload += msg.copy
    flags = FLAG_GREEDY if msg.step is not None and msg.step.greedy else 0
    header = [MAGIC, msg.kind, len(seqs), n_tokens, len(msg.release), len(payload), flags, 0]
    if len(payload) <= FRAME - HEADER:
        frame = header + payload + [0] * (FRAME - HEADER - len(payload))
        return torch.tensor(frame, dtype=torch.int64), None
    frame = header + [0] * (FRAME - HEADER)
    return torch.tensor(frame, dtype=torch.int64), torch.tensor(payload, dtype=torch.int64)


def payload_len(frame: torch.Tensor) -> int:
    """How many payload values follow the frame in a second tensor (0 when inline)."""
    _check_header(frame)
    n = int(frame[5])
    return n if n > FRAME - HEADER else 0


def decode(frame: torch.Tensor, extra: torch.Tensor | None = None) -> Control:
    """Inverse of `encode`; raises `ControlError` on anything inconsistent."""
    _check_header(frame)
    kind, n_seqs, n_tokens, n_release, n_payload, flags = (int(v) for v in frame[1:7])
    if n_payload <= FRAME - HEADER:
        payload = frame[HEADER : HEADER + n_payload].tolist()
    else:
        if extra is None or extra.numel() != n_payload:
            raise ControlError(f"control payload of {n_payload} values is missing or truncated")
        payload = extra.tolist()
    n_copy = COPY_LEN if kind == KIND_COPY else 0
    if n_payload != 3 * n_seqs + n_tokens + n_release + n_copy:
        raise ControlError("control frame counts disagree with its payload length")
    end = len(payload) - n_copy
    release = tuple(payload[end - n_release : end]) if n_release else ()
    if kind != KIND_STEP:
        if n_seqs:
            raise ControlError(f"control kind {kind} carries sequences")
        copy = None
        if n_copy:
            src, dst, n = payload[end:]
            if min(src, dst) < 0 or n < 1 or src == dst:
                raise ControlError(f"control copy of {n} positions from {src} to {dst}")
            copy = (src, dst, n)
        return Control(kind, None, release, copy)
    seqs = []
    pos = 3 * n_seqs
    for i in range(n_seqs):
        seq_id, start, n_tok = payload[3 * i : 3 * i + 3]
        if n_tok < 1 or start < 0 or pos + n_tok > 3 * n_seqs + n_tokens:
            raise ControlError(f"control sequence {seq_id}: bad length {n_tok} or start {start}")
        seqs.append(StepSequence(seq_id, tuple(payload[pos : pos + n_tok]), start))
        pos += n_tok
    if pos != 3 * n_seqs + n_tokens:
        raise ControlError("control token count disagrees with the sequences' lengths")
    return Control(kind, Step(tuple(seqs), greedy=bool(flags & FLAG_GREEDY)), release)


def _check_header(frame: torch.Tensor) -> None:
    if frame.dtype != torch.int64 or frame.shape != (FRAME,):
        raise ControlError(
            f"control frame must be int64 ({FRAME},), got {frame.dtype} {tuple(frame.shape)}"
        )
    if int(frame[0]) != MAGIC:
        raise ControlError("control frame has the wrong magic: peers are out of step")
    kind = int(frame[1])
    if kind not in KINDS:
        raise ControlError(f"unknown control kind {kind}")
    if any(int(v) < 0 for v in frame[2:6]):
        raise ControlError("negative count in control frame")
    if int(frame[6]) & ~FLAG_GREEDY or int(frame[7]) != 0:
        raise ControlError(f"unknown control flags {int(frame[6])} / {int(frame[7])}")


def send_control(comm: Communicator, msg: Control, src: int = 0) -> None:
    """Broadcasts `msg` from `src` (the frame, then the long payload if there is one)."""
    frame, extra = encode(msg)
    comm.broadcast(frame, src)
    if extra is not None:
        comm.broadcast(extra, src)


def recv_control(comm: Communicator, src: int = 0) -> Control:
    """The receiving side of `send_control` on every rank but `src`."""
    frame = comm.broadcast(torch.zeros(FRAME, dtype=torch.int64), src)
    n = payload_len(frame)
    extra = comm.broadcast(torch.zeros(n, dtype=torch.int64), src) if n else None
    return decode(frame, extra)
