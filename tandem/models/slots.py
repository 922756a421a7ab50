"""Which KV cache slot each live sequence holds, and the cache's errors: plain bookkeeping, no
tensors, so the head and a torch-free executor use it without importing torch. `kv_cache`
re-exports every name here."""

from __future__ import annotations

from collections.abc import Sequence


class CacheFullError(RuntimeError):
    """Every slot is taken by a live sequence."""


class SequenceTooLongError(ValueError):
    """A sequence would run past the cache's max_seq_len."""


class SlotTable:
    """Maps live sequence ids to cache slots; the lowest free slot first, so that every rank that
    sees the same steps in the same order assigns the same slots."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self._slot: dict[int, int] = {}
        self._free = list(range(n_slots))

    def slot(self, seq_id: int) -> int:
        """The slot of `seq_id`, assigning the lowest free one to a new sequence."""
        s = self._slot.get(seq_id)
        if s is None:
            if not self._free:
                raise CacheFullError(f"all {self.n_slots} KV cache slots are in use")
            s = self._slot[seq_id] = self._free.pop(0)
        return s

    def plan(self, seq_ids: Sequence[int]) -> list[int]:
        """The slot each of `seq_ids` would get from `slot`, called in order, without taking any;
        `CacheFullError` when the new ones outnumber the free slots."""
        free = iter(self._free)
        out = []
        for sid in seq_ids:
            s = self._slot.get(sid)
            if s is None:
                s = next(free, None)
                if s is None:
                    raise CacheFullError(f"all {self.n_slots} KV cache slots are in use")
            out.append(s)
        return out

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slot

    def release(self, seq_id: int) -> None:
        s = self._slot.pop(seq_id, None)
        if s is not None:
            self._free.append(s)
            self._free.sort()
