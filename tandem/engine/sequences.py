"""`SequenceCache`: what one process holds of each live sequence, and the one rule a step obeys.

Every runner keeps, per sequence id, a cache slot (one row of its `KVCache`) and the number of
tokens already written there. A whole-model executor, each rank of a TP group, each pipeline stage
and the pipeline's head all hold one of these, and all check a step by the same rule:

    1 <= B <= max_batch                      B = the step's sequences, each id at most once
    0 <= start_pos <= cached(seq)            continue where the cache ends, or rewind (re-prefill);
                                             never leave a gap
    start_pos in (0, cached(seq))            a hybrid model (Gated DeltaNet layers, `recurrent`):
                                             its recurrent state cannot go back to an earlier
                                             position, so a rewind other than to 0 (a full
                                             re-prefill) is `RecurrentRewindError`
    start_pos + len(token_ids) <= max_seq_len
    0 <= token id < vocab_size               where this process embeds the tokens
    new sequences <= free slots

A prefix copy (`copy`: the first n positions of sequence `src` into a new sequence `dst`, every
layer's keys and values) obeys its own rule, checked the same way before anything changes:

    1 <= n <= cached(src)                    only positions the source holds
    dst is new, a slot is free               it takes the lowest free slot, as a step's new one
    n == cached(src)                         a hybrid model: a recurrent state holds no earlier
                                             position, so only a whole copy (state and conv
                                             window included) is taken; else `PrefixCopyError`

A violation raises `SequenceError` (its subclass `SequenceTooLongError` for the length bound)
before any state changes, so a step the head refuses never reaches another rank. Slots go to new
sequences lowest first, in step order: every rank that sees the same steps in the same order
holds the same slots.

Where the KV cache's slots share a prefix's pages (`pages`, a `models.kv_pages.KVPages`), this is
also where its block table moves: a checked step's rows make the blocks they will write their own
(`prepare_write`: copy on write, only where a rewind writes into a shared block), a copy maps the
source's whole blocks (`share`), a release frees the slot's blocks. The table is a function of the
steps, copies and releases in their order, so every TP rank and PP stage that sees the same ones
holds the same block ids without a message of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tandem.engine.executor import Step
from tandem.models import slots as kv_slots
from tandem.models.slots import SlotTable

if TYPE_CHECKING:
    from torch import nn

    from tandem.models.kv_cache import KVCache
    from tandem.models.kv_pages import KVPages


class SequenceError(ValueError):
    """A step that breaks the sequence rule (see the module docstring); the message says which."""


class RecurrentRewindError(SequenceError):
    """A step that rewinds a hybrid model's sequence to a position other than 0 or its end: a
    recurrent (DeltaNet) state holds no earlier positions to go back to."""


class PrefixCopyError(SequenceError):
    """A prefix copy that breaks its rule (module docstring): an unknown or too short source, a
    destination already live, no free slot, or a partial copy of a hybrid model's sequence."""


class SequenceTooLongError(SequenceError, kv_slots.SequenceTooLongError):
    """A sequence would run past `max_seq_len` (also the KV cache's own error type)."""


class SequenceCache:
    """Per live sequence: its slot in `kv` (None: this process holds no layers) and its length.
    The bookkeeping needs no torch; only `for_model`, which builds a `KVCache`, imports it.

    `owner` names the holder in messages ("this stage"); `vocab_size` (None: not checked) bounds
    the token ids where this process embeds them."""

    def __init__(
        self,
        max_batch: int,
        max_seq_len: int,
        *,
        kv: KVCache | None = None,
        vocab_size: int | None = None,
        owner: str = "the KV cache",
        recurrent: bool = False,
        pages: KVPages | None = None,
    ) -> None:
        """`pages`: the shared pages of the KV cache (module docstring); by default `kv`'s."""
        self.pages = pages if pages is not None else getattr(kv, "pages", None)
        self.recurrent = recurrent
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.kv = kv
        self.vocab_size = vocab_size
        self.owner = owner
        self.slots = SlotTable(max_batch)
        self._length: dict[int, int] = {}  # seq_id -> tokens written in its slot

    @classmethod
    def for_model(
        cls, model: nn.Module, max_batch: int, max_seq_len: int, *, owner: str = "the KV cache"
    ) -> SequenceCache:
        """A cache sized for the layers `model` holds (none: no `kv`), checking token ids when
        `model` holds the embedding."""
        from tandem.models.kv_cache import KVCache  # torch: only a model's own cache needs it

        kv = KVCache.for_model(model, max_batch, max_seq_len) if len(model.model.layers) else None
        vocab = model.config.vocab_size if model.with_embed else None
        return cls(
            max_batch, max_seq_len, kv=kv, vocab_size=vocab, owner=owner,
            recurrent=model.config.hybrid,
        )  # fmt: skip

    def cached(self, seq_id: int) -> int:
        """Tokens of `seq_id` already held (0 for a sequence not seen)."""
        return self._length.get(seq_id, 0)

    def __len__(self) -> int:
        return len(self._length)

    def check(self, step: Step) -> list[int]:
        """Raises `SequenceError` for a step that breaks the rule; else each row's slot (B,), new
        sequences' slots planned but not yet taken (`advance` takes them)."""
        seqs = step.sequences
        return self.check_rows(
            [s.seq_id for s in seqs],
            [s.start_pos for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.token_ids for s in seqs],
        )

    def check_rows(
        self,
        seq_ids: Sequence[int],
        start_pos: Sequence[int],
        lengths: Sequence[int],
        token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """`check` for a step given as rows (a stage's frame carries no token ids)."""
        n = len(seq_ids)
        if not 1 <= n <= self.max_batch:
            raise SequenceError(f"a step holds 1..{self.max_batch} sequences, got {n}")
        if len(set(seq_ids)) != n:
            raise SequenceError("a sequence appears twice in one step")
        new = 0
        for b, (sid, pos, length) in enumerate(zip(seq_ids, start_pos, lengths)):
            if length < 1:
                raise SequenceError(f"sequence {sid}: no new tokens")
            have = self._length.get(sid)
            new += have is None
            if not 0 <= pos <= (have or 0):
                raise SequenceError(
                    f"sequence {sid} starts at {pos} but {self.owner} holds {have or 0} tokens "
                    f"(start_pos {pos}: a step continues or rewinds a sequence, never skips)"
                )
            if self.recurrent and 0 < pos < (have or 0):
                raise RecurrentRewindError(
                    f"sequence {sid} starts at {pos} but {self.owner} holds {have} tokens of a "
                    f"hybrid model: its recurrent state continues at {have} or restarts at 0"
                )
            if pos + length > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {sid} would reach {pos + length} tokens; "
                    f"max_seq_len is {self.max_seq_len}"
                )
            if self.vocab_size is not None and token_ids is not None:
                ids = token_ids[b]
                if min(ids) < 0 or max(ids) >= self.vocab_size:
                    raise SequenceError(f"sequence {sid}: token id outside [0, {self.vocab_size})")
        free = self.max_batch - len(self._length)
        if new > free:
            raise SequenceError(f"{new} new sequences but only {free} free KV cache slots")
        slots = self.slots.plan(seq_ids)
        if self.pages is not None:  # the blocks the rows write are theirs alone (copy on write)
            for slot, pos, length in zip(slots, start_pos, lengths):
                self.pages.prepare_write(slot, pos, pos + length)
        return slots

    def advance(self, step: Step) -> None:
        """Records a step that ran: each sequence takes its planned slot and now holds
        `start_pos + len(token_ids)` tokens."""
        for s in step.sequences:
            self.slots.slot(s.seq_id)
            self._length[s.seq_id] = s.start_pos + len(s.token_ids)

    def advance_rows(
        self, seq_ids: Sequence[int], start_pos: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """`advance` for a step given as rows."""
        for sid, pos, length in zip(seq_ids, start_pos, lengths):
            self.slots.slot(sid)
            self._length[sid] = pos + length

    def check_copy(self, src: int, dst: int, n: int) -> tuple[int, int]:
        """Raises `PrefixCopyError` for a copy that breaks the rule (module docstring); else
        (source slot, destination slot), the destination's planned but not yet taken."""
        have = self._length.get(src)
        if have is None:
            raise PrefixCopyError(f"copy from sequence {src}, which {self.owner} does not hold")
        if not 1 <= n <= have:
            raise PrefixCopyError(
                f"copy of {n} positions from sequence {src}, which holds {have} in {self.owner}"
            )
        if dst in self._length or dst in self.slots:
            raise PrefixCopyError(f"copy into sequence {dst}, which is already live")
        if self.recurrent and n != have:
            raise PrefixCopyError(
                f"copy of {n} of the {have} positions of sequence {src} of a hybrid model: a "
                f"recurrent state holds no earlier position, only a whole copy is taken"
            )
        if len(self._length) >= self.max_batch:
            raise PrefixCopyError(f"copy into sequence {dst}: all {self.max_batch} slots are live")
        return self.slots.plan([src])[0], self.slots.plan([dst])[0]

    def copy(self, src: int, dst: int, n: int) -> tuple[int, int]:
        """Records a prefix copy (`check_copy` first): `dst` takes its slot and holds `n`
        tokens. Returns (source slot, destination slot) for the caller to copy the tensors."""
        slots = self.check_copy(src, dst, n)
        self.slots.slot(dst)
        self._length[dst] = n
        if self.kv is not None:
            self.kv.copy_prefix(*slots, n)
        return slots

    def release(self, seq_ids: Iterable[int]) -> None:
        """Frees the sequences' slots (unknown ids are ignored)."""
        for sid in seq_ids:
            if self.pages is not None and sid in self.slots:
                self.pages.release(self.slots.slot(sid))
            self.slots.release(sid)
            self._length.pop(sid, None)

    def clear(self) -> None:
        self.release(list(self._length))
