"""The envelope of the movement collectives (all_gather, broadcast, all_to_all) that the host-staged
backends share (the ring's general road, the star): check the input, encode it in the wire dtype
(`staging`), take the op's sequence number, fingerprint the op's logical (op, dtype, shape), run
the backend's algorithm under its failure guard, and decode each part on the caller's device in
the caller's dtype. The backend brings the algorithm and these hooks:

    _wire                 the negotiated float wire dtype (`wire.dtypes.WireDtype`)
    _size                 the world size
    _begin() -> seq       the next op's number (refused once the backend is broken)
    _run(fn, *args)       fn(*args); a failure breaks the backend before it propagates
    _fingerprint(op, code, shape) -> int
    _gather_blocks(wire, payload, shape, d, seq, fp) -> [(shape_i, payload_i)] in rank order
    _broadcast(wire, payload, shape, src, seq, fp) -> the root's payload
    _all_to_all(wire, [(shape_k, payload_k)], seq, fp) -> [(shape_i, payload_i)] from rank i
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.comm import base
from tandem.comm.staging import decode_tensor, encode_tensor
from tandem.wire import frame as fr


class StagedMoves:
    """all_gather, broadcast and all_to_all over a backend's hooks (see the module docstring)."""

    _wire: Any
    _size: int

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        base.check_tensor(t, "all_gather", reduce=False)
        d = base.check_dim(t, dim, "all_gather")
        wire, payload = encode_tensor(t, self._wire)
        seq = self._begin()
        others = tuple(0 if i == d else s for i, s in enumerate(t.shape))
        fp = self._fingerprint(fr.ALL_GATHER, wire.code, (*others, d))
        blocks = self._run(self._gather_blocks, wire, payload, tuple(t.shape), d, seq, fp)
        parts = [decode_tensor(p, wire, s, t.dtype, t.device) for s, p in blocks]
        return torch.cat(parts, dim=d)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        base.check_tensor(t, "broadcast", reduce=False)
        base.check_src(src, self._size)
        wire, payload = encode_tensor(t, self._wire)
        seq = self._begin()
        shape = tuple(t.shape)
        fp = self._fingerprint(fr.BROADCAST, wire.code, (*shape, src))
        got = self._run(self._broadcast, wire, payload, shape, src, seq, fp)
        return decode_tensor(got, wire, shape, t.dtype, t.device)

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = base.check_parts(parts, self._size, "all_to_all")
        encoded = [encode_tensor(p, self._wire) for p in parts]
        wire = encoded[0][0]
        seq = self._begin()
        fp = self._fingerprint(fr.ALL_TO_ALL, wire.code, (self._size,))
        items = [(tuple(p.shape), e[1]) for p, e in zip(parts, encoded)]
        got = self._run(self._all_to_all, wire, items, seq, fp)
        like = parts[0]
        return [decode_tensor(p, wire, s, like.dtype, like.device) for s, p in got]

    # the backend's hooks
    def _begin(self) -> int:
        raise NotImplementedError

    def _run(self, fn: Any, *args: Any) -> Any:
        raise NotImplementedError

    def _fingerprint(self, op: int, code: int, shape: tuple[int, ...]) -> int:
        raise NotImplementedError

    def _gather_blocks(
        self, wire: Any, payload: Any, shape: tuple, d: int, seq: int, fp: int
    ) -> list:
        raise NotImplementedError

    def _broadcast(self, wire: Any, payload: Any, shape: tuple, src: int, seq: int, fp: int) -> Any:
        raise NotImplementedError

    def _all_to_all(self, wire: Any, items: list, seq: int, fp: int) -> list:
        raise NotImplementedError
