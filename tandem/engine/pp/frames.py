"""Pipeline stage messages and the `StageTransport` that carries them between stages.

What crosses a stage boundary is one hidden state per step (the activations of the tokens this step
adds), encoded in the negotiated wire dtype and decoded into the receiver's own compute dtype and
device, plus the step's shape: which sequences, at which start positions, how many new tokens each.
No weights, no logits, no pickles.

A message is one frame (little-endian):

    header   magic "TDPP" | version u8 | kind u8 | dtype code u16 | n_seqs u32 | tag u64 | ndim u32
    seqs     seq_id i64 * n_seqs | start_pos u32 * n_seqs | length u32 * n_seqs
    shape    u32 * ndim
    payload  prod(shape) * itemsize bytes (FORWARD), utf-8 text (ERROR), or nothing

A COPY (a prefix cache's copy, `PipelineExecutor.copy_prefix`) carries no payload: seq_ids
(src, dst), start_pos (0, 0), lengths (n, n); every rank of every stage copies the first n
positions of `src`'s KV cache of the layers it holds into the new sequence `dst`.

A FORWARD hidden state is (B, T, D) with B = n_seqs and T = max(length) (rows left-aligned, padded;
see `tandem.models.context`), or (B, 1, D) on the way back to the head (each row's last token only).
The decoder checks every count against the frame length before it builds a tensor
(`StageMessageError`); a payload is only ever read as the dtype its code names.

Both transports move the same encoded bytes: `LocalStageTransport` through an in-process queue,
`TcpStageTransport` through an authenticated framed connection. Sends are queued and written by a
background thread ("pipelined sends"), so a stage never waits for its downstream neighbour to read
before it takes the next micro-batch.
"""

from __future__ import annotations

import math
import queue
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tandem.devices import DTYPE_NAMES
from tandem.wire import dtypes as wire_dtypes

MAGIC = b"TDPP"
VERSION = 1
KIND_FORWARD = 1  # run your layers over `hidden`, pass the result on
KIND_RELEASE = 2  # free the KV caches of `seq_ids`, pass it on
KIND_STOP = 3  # pass it on, then leave the stage loop
KIND_ERROR = 4  # a stage failed: pass it on to the head, which raises `text`
KIND_COPY = 5  # seq_ids (src, dst), lengths (n, n): copy src's first n positions, pass it on
KINDS = (KIND_FORWARD, KIND_RELEASE, KIND_STOP, KIND_ERROR, KIND_COPY)

_HEADER = struct.Struct("<4sBBHIQI")
MAX_SEQS = 1 << 16
MAX_NDIM = 4
MAX_ERROR_BYTES = 1 << 16


class StageMessageError(ValueError):
    """A stage frame that is malformed: bad magic/version/kind, or counts that disagree."""


class StageLinkError(ConnectionError):
    """A stage link is closed, timed out, or its peer died."""


@dataclass(frozen=True)
class StageMessage:
    """One step's traffic across a stage boundary (`tag` numbers micro-batches, for sanity checks)."""

    kind: int
    tag: int = 0
    seq_ids: tuple[int, ...] = ()
    start_pos: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    hidden: torch.Tensor | None = field(default=None, compare=False)
    text: str = ""


def wire_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a negotiable wire dtype name (float32, bfloat16, float16)."""
    return DTYPE_NAMES[wire_dtypes.negotiable(name).name]


def encode(msg: StageMessage, wire_dtype: str = "float32") -> bytes:
    """`msg` -> one frame; a hidden state is cast (on the host) to `wire_dtype` first."""
    if msg.kind not in KINDS:
        raise StageMessageError(f"unknown stage message kind {msg.kind}")
    n = len(msg.seq_ids)
    if not (len(msg.start_pos) == len(msg.lengths) == n):
        raise StageMessageError("seq_ids, start_pos and lengths must have the same length")
    code, shape, payload = 0, (), b""
    if msg.hidden is not None:
        wd = wire_dtypes.negotiable(wire_dtype)
        code = wd.code
        # device -> host, compute dtype -> wire dtype: the one explicit cast at the seam
        t = msg.hidden.detach().to("cpu").to(DTYPE_NAMES[wd.name]).contiguous()
        shape = tuple(t.shape)
        payload = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    elif msg.kind == KIND_ERROR:
        payload = msg.text.encode()[:MAX_ERROR_BYTES]
    parts = [
        _HEADER.pack(MAGIC, VERSION, msg.kind, code, n, msg.tag, len(shape)),
        struct.pack(f"<{n}q", *msg.seq_ids),
        struct.pack(f"<{n}I", *msg.start_pos),
        struct.pack(f"<{n}I", *msg.lengths),
        struct.pack(f"<{len(shape)}I", *shape),
        payload,
    ]
    return b"".join(parts)


def decode(
    frame: bytes,
    *,
    wire_dtype: str = "float32",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> StageMessage:
    """One frame -> `StageMessage`, the hidden state decoded as `wire_dtype` (the agreed one: any
    other code fails closed) and converted to the receiver's `dtype` on `device`."""
    if len(frame) < _HEADER.size:
        raise StageMessageError(f"stage frame of {len(frame)} bytes is shorter than its header")
    magic, version, kind, code, n, tag, ndim = _HEADER.unpack_from(frame, 0)
    if magic != MAGIC:
        raise StageMessageError("not a stage frame (bad magic)")
    if version != VERSION:
        raise StageMessageError(f"stage frame version {version}, this build speaks {VERSION}")
    if kind not in KINDS:
        raise StageMessageError(f"unknown stage message kind {kind}")
    if n > MAX_SEQS or ndim > MAX_NDIM:
        raise StageMessageError(f"stage frame claims {n} sequences and {ndim} dims")
    off = _HEADER.size
    meta_len = 16 * n + 4 * ndim
    if len(frame) < off + meta_len:
        raise StageMessageError("stage frame truncated inside its sequence table")
    seq_ids = struct.unpack_from(f"<{n}q", frame, off)
    start_pos = struct.unpack_from(f"<{n}I", frame, off + 8 * n)
    lengths = struct.unpack_from(f"<{n}I", frame, off + 12 * n)
    shape = struct.unpack_from(f"<{ndim}I", frame, off + 16 * n)
    off += meta_len
    body = memoryview(frame)[off:]
    if kind == KIND_ERROR:
        return StageMessage(
            kind, tag, seq_ids, start_pos, lengths, text=bytes(body).decode("utf-8", "replace")
        )
    if kind == KIND_COPY and (
        n != 2 or seq_ids[0] == seq_ids[1] or lengths[0] != lengths[1] or lengths[0] < 1
    ):
        raise StageMessageError(f"stage copy frame of {seq_ids} and {lengths} is malformed")
    if code == 0:
        if ndim or len(body):
            raise StageMessageError(f"stage message kind {kind} carries an untyped payload")
        return StageMessage(kind, tag, seq_ids, start_pos, lengths)
    wd = wire_dtypes.by_code(code)
    agreed = wire_dtypes.negotiable(wire_dtype)
    if wd.code != agreed.code:
        raise StageMessageError(
            f"hidden state sent as {wd.name}, but the agreed wire dtype is {agreed.name}"
        )
    if ndim != 3 or shape[0] != n or (n and shape[1] > max(lengths)):
        raise StageMessageError(
            f"hidden state of shape {shape} does not fit {n} sequences of {lengths}"
        )
    if len(body) != math.prod(shape) * wd.itemsize:
        raise StageMessageError(
            f"hidden state payload of {len(body)} bytes for shape {shape} {wd.name}"
        )
    h = (
        torch.frombuffer(bytearray(body), dtype=DTYPE_NAMES[wd.name])
        if len(body)
        else torch.empty(0)
    )
    h = h.reshape(shape).to(device=device, dtype=dtype)  # wire dtype -> this stage's compute dtype
    return StageMessage(kind, tag, seq_ids, start_pos, lengths, hidden=h)


class StageTransport(Protocol):
    """One direction of a stage link: `send` queues a frame for the peer, `recv` returns the next
    frame from it within `timeout` seconds or raises `StageLinkError`; `bytes_sent` and
    `bytes_received` count the stage frames' bytes each way."""

    bytes_sent: int
    bytes_received: int

    def send(self, frame: bytes) -> None: ...

    def recv(self, timeout: float) -> bytes: ...

    def close(self) -> None: ...


_CLOSED = object()


class LocalStageTransport:
    """Both ends of an in-process link (one queue per direction); used when two stages share a
    process, and as the oracle the TCP transport must match byte for byte."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self._inbox, self._outbox = inbox, outbox
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    def pair(cls) -> tuple[LocalStageTransport, LocalStageTransport]:
        a, b = queue.Queue(), queue.Queue()
        return cls(a, b), cls(b, a)

    def send(self, frame: bytes) -> None:
        self.bytes_sent += len(frame)
        self._outbox.put(bytes(frame))

    def recv(self, timeout: float) -> bytes:
        try:
            frame = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise StageLinkError(f"no stage frame within {timeout:.1f} s") from None
        if frame is _CLOSED:
            raise StageLinkError("the stage link was closed by its peer")
        self.bytes_received += len(frame)
        return frame

    def close(self) -> None:
        self._outbox.put(_CLOSED)


class FramedConnection(Protocol):
    """What `TcpStageTransport` needs of an authenticated framed connection."""

    def send_frame(self, payload: bytes) -> None: ...

    def recv_frame(self, timeout: float | None = None) -> bytes: ...

    def close(self) -> None: ...


class TcpStageTransport:
    """A stage link over an authenticated framed TCP connection; a sender thread writes queued
    frames in order, so `send` returns at once. A send error is raised by the next call."""

    def __init__(self, conn: FramedConnection, name: str = "stage link") -> None:
        self._conn = conn
        self.name = name
        self.bytes_sent = 0  # stage frames, as the in-process transport counts them
        self.bytes_received = 0
        self._overhead = getattr(conn, "frame_overhead", 0)  # the transport's header per frame
        self._frames = 0
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._sender, name=f"send {name}", daemon=True)
        self._thread.start()

    def _sender(self) -> None:
        while True:
            frame = self._queue.get()
            if frame is _CLOSED:
                return
            try:
                self._conn.send_frame(frame)
            except BaseException as e:  # noqa: BLE001 - handed to the caller on its next call
                self._error = e
                return

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StageLinkError(f"{self.name}: send failed: {self._error}") from self._error

    def send(self, frame: bytes) -> None:
        self._raise_if_failed()
        self.bytes_sent += len(frame)
        self._frames += 1
        self._queue.put(bytes(frame))

    def recv(self, timeout: float) -> bytes:
        self._raise_if_failed()
        try:
            frame = self._conn.recv_frame(timeout)
            self.bytes_received += len(frame)
            self._frames += 1
            return frame
        except StageLinkError as e:
            raise StageLinkError(f"{self.name}: {e}") from e
        except Exception as e:
            raise StageLinkError(f"{self.name}: {type(e).__name__}: {e}") from e

    @property
    def channel(self) -> Any:
        """The authenticated channel under this link (`links.ChannelConnection`), or None."""
        return getattr(self._conn, "ch", None)

    def socket_bytes(self) -> int:
        """Bytes this link moved both ways, the transport's frame headers included."""
        return self.bytes_sent + self.bytes_received + self._overhead * self._frames

    def shutdown(self) -> None:
        """Cuts the connection both ways at once (from any thread): a `recv` waiting on it wakes
        with StageLinkError, as does the next send."""
        cut = getattr(self._conn, "shutdown", None)
        if cut is not None:
            cut()

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until every queued frame is written (or the sender failed)."""
        self._queue.put(_CLOSED)
        self._thread.join(timeout)
        self._raise_if_failed()
        if self._thread.is_alive():
            raise StageLinkError(f"{self.name}: queued frames not written within {timeout} s")
        self._thread = threading.Thread(target=self._sender, name=f"send {self.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._queue.put(_CLOSED)
        self._thread.join(5.0)
        self._conn.close()


def send_to_all(links: Sequence[StageTransport], frame: bytes) -> None:
    """The same frame to every rank of the next stage (a tensor-parallel stage's ranks all need it)."""
    for link in links:
        link.send(frame)
