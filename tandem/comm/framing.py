"""Receiving collective frames: exact-header checks for frames of known shape, bounded reads for
frames of unknown shape, and desync diagnosis. Shared by the ring and the star."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.comm import base
from tandem.wire import frame as fr

RecvInto = Callable[..., None]  # recv_into(view: memoryview, on_progress=None)

# broadcast's header-only frames (shape (0,)): the root claim each rank sends so that ranks which
# disagree on the root fail, and the abort a rank that found a disagreement sends on; steps a
# chain of at most 2^16 - 2 hops never uses
CLAIM_STEP, ABORT_STEP = 0xFFFF, 0xFFFE


def data_header(op: int, code: int, seq: int, fp: int, shape: tuple[int, ...], step: int) -> bytes:
    return fr.encode_header(fr.DATA, op, code, seq, fp, shape, step)


class FrameReader:
    """Reads frames from the peer of rank `peer_rank` through `recv_into`."""

    def __init__(
        self, recv_into: RecvInto, my_rank: int, peer_rank: int, max_frame_bytes: int
    ) -> None:
        self.recv_into = recv_into
        self.my_rank, self.peer_rank = my_rank, peer_rank
        self.max_frame_bytes = max_frame_bytes
        self._fixed = bytearray(fr.FIXED_SIZE)
        self._fixed_view = memoryview(self._fixed)

    def desync(self, expect: bytes, got: bytes | bytearray) -> base.OpDesyncError:
        want, _ = fr.decode_fixed(expect[: fr.FIXED_SIZE])
        have, _ = fr.decode_fixed(bytes(got[: fr.FIXED_SIZE]))  # BadMagic / Version raise here
        if (have.op, have.seq) == (want.op, want.seq) and have.fingerprint != want.fingerprint:
            what = "shape, dtype or root" if have.op == fr.BROADCAST else "shape or dtype"
            return base.OpDesyncError(
                f"rank {self.my_rank}: rank {self.peer_rank} called {fr.OPS[have.op]} #{have.seq} "
                f"with another {what} than this rank (fingerprints differ; this rank "
                f"expected {want.describe()})"
            )
        return base.OpDesyncError(
            f"rank {self.my_rank}: expected {want.describe()} from rank {self.peer_rank}, "
            f"got {have.describe()}"
        )

    def known(self, expect: bytes, payload: memoryview, on_progress: Any = None) -> None:
        """A frame whose header must equal `expect` byte for byte; its payload into `payload`."""
        self.recv_into(self._fixed_view)
        if self._fixed != expect[: fr.FIXED_SIZE]:
            raise self.desync(expect, self._fixed)
        if len(expect) > fr.FIXED_SIZE:
            rest = bytearray(len(expect) - fr.FIXED_SIZE)
            self.recv_into(memoryview(rest))
            if rest != expect[fr.FIXED_SIZE :]:
                raise self.desync(expect, self._fixed)
        if payload.nbytes:
            if on_progress is None:
                self.recv_into(payload)
            else:
                self.recv_into(payload, on_progress)

    def known_small(self, expect: bytes, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """Like `known`, but header and payload arrive in one buffer (fewer system calls for the
        small, latency-bound frames); the fixed header is checked as soon as it has arrived."""
        buf = bytearray(len(expect) + nbytes)
        view = memoryview(buf)
        fixed = expect[: fr.FIXED_SIZE]
        checked = [False]

        def check_fixed(got: int) -> None:
            if not checked[0] and got >= fr.FIXED_SIZE:
                checked[0] = True
                if view[: fr.FIXED_SIZE] != fixed:
                    raise self.desync(expect, buf)

        self.recv_into(view, check_fixed)
        if view[: len(expect)] != expect:
            raise self.desync(expect, buf)
        return np.frombuffer(buf, dtype=dtype, offset=len(expect))

    def any(self, op: int, seq: int, fp: int, step: int) -> tuple[fr.FrameHeader, np.ndarray]:
        """A frame of unknown shape: header checked and length bounded before allocation."""
        self.recv_into(self._fixed_view)
        header, ndim = fr.decode_fixed(self._fixed)
        if (header.kind, header.op, header.seq, header.fingerprint, header.step) != (
            fr.DATA, op, seq, fp, step,
        ):  # fmt: skip
            raise self.desync(data_header(op, header.dtype, seq, fp, (), step), self._fixed)
        dims = bytearray(8 * ndim)
        self.recv_into(memoryview(dims))
        header = fr.decode_shape(header, dims)
        n = fr.check_length(header, self.max_frame_bytes)
        payload = np.empty(n, dtype=np.uint8)
        self.recv_into(memoryview(payload))
        return header, payload


def check_gathered_shape(
    header: fr.FrameHeader, code: int, shape: tuple[int, ...], d: int, src: int
) -> None:
    """An all_gather block agrees with this rank's part except along `d`."""
    if (
        header.dtype != code
        or len(header.shape) != len(shape)
        or any(a != b for i, (a, b) in enumerate(zip(header.shape, shape)) if i != d)
    ):
        raise base.RaggedPartsError(
            f"all_gather: rank {src} sent shape {header.shape} but this rank has {shape}; "
            f"parts may differ only along dim {d}"
        )
