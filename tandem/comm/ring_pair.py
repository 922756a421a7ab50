"""The ring's decode road over TCP: N = 2, the float32 wire, a small float32 CPU tensor.

One frame each way, sent before anything else is done; the sum is `x + peer`, which equals the
RANK_ORDER sum x_0 + x_1 bit for bit on both ranks (float addition is commutative). The frames are
those of the general road (`ring_tcp.TcpRing.sum_rank_order`: flat payload, fingerprint of the
real shape, step 0), so a rank on the general road (say, a bfloat16 rank) meets this one. Every
check of the general road holds: the peer's header must equal ours byte for byte (op, sequence
number, step, fingerprint of op/dtype/shape; the fixed part as soon as it has arrived), else
OpDesyncError.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.comm.framing import FrameReader, data_header
from tandem.comm.ring_link import RingLink
from tandem.comm.staging import stage_to_host, unstage
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr

_PLANS_MAX = 512


class _PairPlan:
    """Per tensor shape, what the road reuses: the frame's fingerprint and shape bytes, and a
    receive buffer (header + payload) the peer's frame lands in."""

    __slots__ = ("fp", "dims", "nbytes", "buf", "view", "payload", "expect", "checked", "_reader")

    def __init__(self, fp: int, dims: bytes, nbytes: int, reader: FrameReader) -> None:
        self.fp, self.dims, self.nbytes, self._reader = fp, dims, nbytes, reader
        self.buf = bytearray(fr.FIXED_SIZE + len(dims) + nbytes)
        self.view = memoryview(self.buf)
        self.payload = np.frombuffer(self.buf, np.float32, offset=fr.FIXED_SIZE + len(dims))
        self.expect, self.checked = b"", False

    def check(self, got: int) -> None:
        """The fixed header as soon as it has arrived: a peer in another op fails at once."""
        if not self.checked and got >= fr.FIXED_SIZE:
            self.checked = True
            if self.view[: fr.FIXED_SIZE] != self.expect[: fr.FIXED_SIZE]:
                raise self._reader.desync(self.expect, self.buf)


class TcpPair:
    """The N = 2 float32 all-reduce of tensors up to `max_numel` elements over `link`."""

    def __init__(self, link: RingLink) -> None:
        self.link = link
        self.max_numel = link.small // 4
        self._plans: dict = {}

    def takes(self, t: torch.Tensor) -> bool:
        """Eligible: a float32 CPU tensor, contiguous, detached, of at most `max_numel`."""
        return (
            isinstance(t, torch.Tensor)
            and t.dtype is torch.float32
            and t.is_cpu
            and t.numel() <= self.max_numel
            and t.is_contiguous()
            and not t.requires_grad
        )

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        link = self.link
        link.check_open()
        try:
            return self._sum(t)
        except BaseException as e:
            err = link.failed(e)
            if err is e:
                raise
            raise err from e

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        link = self.link
        seq = link.seq = link.seq + 1
        plan = self._plans.get(t.shape)
        if plan is None:
            plan = self._plan(tuple(t.shape))
        x = stage_to_host(t, torch.float32)  # aliases t: no copy
        head = fr.pack_header(
            fr.DATA, fr.ALL_REDUCE, wd.FLOAT32.code, 1, 0, seq, plan.fp, plan.nbytes, plan.dims
        )
        link.io.send_small(head, x)
        plan.expect, plan.checked = head, False
        link.io.recv_small(plan.view, plan.check)
        if plan.view[: len(head)] != head:
            raise link.reader.desync(head, plan.buf)
        out = np.add(x, plan.payload)
        link.io.flush()  # a no-op unless the send was queued (it must not outlive x)
        return unstage(out, tuple(t.shape), t)

    def _plan(self, shape: tuple[int, ...]) -> _PairPlan:
        if len(self._plans) > _PLANS_MAX:
            self._plans.clear()
        n = 1
        for d in shape:
            n *= d
        head = data_header(fr.ALL_REDUCE, wd.FLOAT32.code, 0, 0, (n,), 0)
        fp = self.link.fingerprint(fr.ALL_REDUCE, wd.FLOAT32.code, shape)
        plan = _PairPlan(fp, head[fr.FIXED_SIZE :], 4 * n, self.link.reader)
        self._plans[torch.Size(shape)] = plan
        return plan
