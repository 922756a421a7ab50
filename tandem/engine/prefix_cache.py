"""The prefix cache's index on the head: which sequences the executor holds, by their tokens, and
how a new prompt reuses them. Pure bookkeeping (no torch, no executor); the scheduler drives it
(`tandem.engine.scheduler`).

The design is llama.cpp server's slots with `cache_prompt`, plus copies between slots that share
the copied prefix's memory (the executors' KV cache is in blocks whose pages a copy maps:
`models.kv_pages`; Blocks below). Every executor keeps a sequence's KV cache in a preallocated slot until `release`; a
finished request's sequence is kept instead of released, as an entry: its seq_id and the tokens
whose keys and values are in its slot (prompt + generated tokens that were fed; the last sampled
token never was). A running request's sequence is indexed too (`track`, a live entry: its
prompt, of which the first `written` tokens are in its slot so far). A new prompt reuses the
entry it shares the longest common prefix with, p tokens, and prefills only `prompt[p:]`:

    reuse  p = min(common prefix, len(prompt) - 1)   at least one token is prefilled: its logits
                                                     give the first sampled token
    a hit  p >= min_tokens                           else a miss: a fresh slot, prefilled whole

    take over   a kept entry continued exactly        the next chat turn: the request continues
                (p = all it holds)                    the entry's sequence, no copy
    copy        any other hit                         the request gets a fresh slot and the
                                                      executor copies the entry's first p
                                                      positions into it (`Executor.copy_prefix`);
                                                      the entry stays for others

A copy is what lets requests share a prefix: an entry that is busy (a live one: another request
is running on it) or that a take-over would truncate (the prompt parts from it before its end,
which would overwrite its tail) is copied from, never destroyed. A copy from a live entry whose
prefill has not yet reached p waits for it (`ready`): so 8 concurrent requests with the same
1,000-token system prompt prefill it once, and the other 7 copy it as soon as it is written.

Blocks: the executors keep the KV cache in blocks of `block.tokens` positions
(`models.kv_pages`), and a copy maps the source's whole blocks instead of copying them, so
sequences that share a prefix share its memory. The index mirrors that: each sequence holds
blocks (uid, j), j < ceil(tokens / block.tokens), its own uid's, after the whole blocks it
inherited from the source of its copy (`done(hit, into)`); a rewind (a take-over at p below its
end) keeps blocks j < p // block.tokens and starts a new uid, as the executor copies the block
it writes into on write. Memory is counted by distinct blocks:

    held_blocks    blocks any indexed sequence (kept or live) holds, each once
    cache_bytes    block.bytes x blocks only kept entries hold (no live sequence does) +
                   block.entry_bytes per kept entry (a hybrid's recurrent state)

`max_bytes` (`serve --cache-mem`) bounds `cache_bytes`: `trim` evicts the least recently used
unpinned kept entries until it fits (an evicted entry frees only the blocks no one else holds).

Slots: a kept entry holds one of the executor's `max_batch` slots, a copy needs a free one;
`max_entries` bounds the kept entries below that, the least recently used going first (`trim`).
When a
request needs a slot and none is free, the least recently used kept entry goes (`evict`; the
caller releases its sequence), never one a planned copy still reads (`pinned`); where the only
kept entry is the one a copy would read, the request takes it over instead (rewinding it to p,
the one case an entry loses its tail).

Tokens, not messages, are matched, so a chat template that renders earlier turns differently
still reuses the common part. Copied tokens are cached tokens (`reused_tokens`, the request's
`cached_tokens`); `copies` counts the copies.

A hybrid model (Qwen3.5's Gated DeltaNet layers) holds a recurrent state per sequence, which
cannot be rewound or cut at an earlier position (`engine.sequences.RecurrentRewindError`,
`PrefixCopyError`): with `whole_entries` an entry is reused only at exactly the length its slot
holds, p = held (a kept entry: taken over by the next turn; a live one: copied whole, before it
moves on), by a prompt that continues all of its tokens; any shorter match is a miss.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MIN_TOKENS = 16

__all__ = [
    "BlockSize",
    "DEFAULT_MIN_TOKENS",
    "PrefixCache",
    "PrefixHit",
    "common_prefix",
]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    a, b = tuple(a), tuple(b)  # a list never equals a tuple
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the whole shorter one (a C-speed compare): the usual chat turn
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class BlockSize:
    """The executors' KV block: `tokens` positions, `bytes` of KV over the whole model (every
    layer, every rank's heads), and `entry_bytes` every sequence holds whatever its length (a
    hybrid's recurrent state)."""

    tokens: int = 16
    bytes: int = 0
    entry_bytes: int = 0


@dataclass(frozen=True)
class PrefixHit:
    """A request's reuse of an entry: sequence `seq_id` holds (or, live, will hold) `held` tokens,
    of which the first `reused` are the request's prompt's. `copy` False: the request continues
    `seq_id` itself from position `reused`; True: it gets a fresh sequence into which the caller
    copies `seq_id`'s first `reused` positions once `ready` says so, then `done`."""

    seq_id: int
    reused: int
    held: int
    copy: bool = False


class PrefixCache:
    """Kept entries (seq_id -> tokens held), least recently used first, and live ones (seq_id ->
    prompt, tokens written). Not thread-safe: one owner (the scheduler's thread) mutates it;
    `stats` reads only counters, safe from any thread."""

    def __init__(
        self,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        whole_entries: bool = False,
        max_entries: int | None = None,
        block: BlockSize | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """`whole_entries`: reuse an entry only at exactly its length (a hybrid model, module
        docstring). `max_entries`: keep at most this many finished sequences (`trim`; None: as
        many as there are idle slots). `block`: the executors' KV block (module docstring);
        `max_bytes`: the kept entries' blocks no live sequence holds in at most this many bytes
        (`serve --cache-mem`; None: unbounded)."""
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be at least 0, got {max_entries}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.block = block or BlockSize()
        if self.block.tokens < 1:
            raise ValueError(f"a block holds at least 1 token, got {self.block.tokens}")
        self.max_bytes = max_bytes
        self._uid: dict[int, int] = {}  # seq_id -> the uid of the blocks it wrote itself
        self._inherited: dict[int, tuple[tuple[int, int], ...]] = {}  # seq_id -> copied blocks
        self._uids = 0
        self._gauges = (0, 0)  # held_blocks, cache_bytes as of the last change (`_refresh`)
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        self.whole_entries = whole_entries
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._live: dict[int, tuple[int, ...]] = {}
        self._written: dict[int, int] = {}
        self._pins: Counter[int] = Counter()  # seq_id -> copies planned from it, not yet made
        self.hits = 0  # requests that continued or copied an entry
        self.misses = 0  # requests that found none worth reusing
        self.reused_tokens = 0  # prompt tokens not prefilled, summed over hits
        self.copies = 0  # hits served by a copy into a fresh slot
        self.evictions = 0
        self.held_tokens = 0  # tokens the kept entries hold now

    def __len__(self) -> int:
        """Kept entries: each holds a slot no running request does."""
        return len(self._entries)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    # ---- what the executor holds ---------------------------------------------------------------

    def put(self, seq_id: int, tokens: Sequence[int]) -> bool:
        """Keeps `seq_id`, whose slot holds `tokens` at positions 0.., as the most recent entry
        (a live one is kept from now on). False (nothing kept: the caller releases it) where it
        is too short ever to be a hit."""
        self._unindex(seq_id)
        if len(tokens) < self.min_tokens or self.max_entries == 0:
            self._forget_blocks(seq_id)
            return False
        self._entries[seq_id] = tuple(tokens)
        self.held_tokens += len(tokens)
        self._refresh()
        return True

    def track(self, seq_id: int, prompt: Sequence[int], written: int = 0) -> None:
        """Indexes a running sequence: its slot will hold `prompt`, of which the first `written`
        tokens are there now (`advance` as it prefills)."""
        self._drop(seq_id)
        self._live[seq_id] = tuple(prompt)
        self._written[seq_id] = written

    def advance(self, seq_id: int, written: int) -> None:
        """A live sequence's slot now holds its first `written` tokens."""
        if seq_id in self._written:
            self._written[seq_id] = written

    def forget(self, seq_id: int) -> None:
        """`seq_id` is no longer indexed: released, its blocks with it."""
        self._unindex(seq_id)
        self._forget_blocks(seq_id)
        self._refresh()

    def _unindex(self, seq_id: int) -> None:
        self._drop(seq_id)
        self._live.pop(seq_id, None)
        self._written.pop(seq_id, None)

    def _forget_blocks(self, seq_id: int) -> None:
        self._uid.pop(seq_id, None)
        self._inherited.pop(seq_id, None)

    # ---- a new prompt ----------------------------------------------------------------------------

    def claim(self, prompt: Sequence[int], free_slots: int = 1) -> PrefixHit | None:
        """How `prompt` reuses the entry it continues furthest (module docstring), None for a
        miss. Equal reuses: a take-over before a copy, then the most recent. A take-over
        takes the entry out of the index (the caller `track`s the request); a copy pins its
        source (`pinned`) until `done`. `free_slots`: slots neither running nor kept; with
        none, a copy needs a kept entry to evict other than its source, else the request
        takes the source over (rewinding it)."""
        best: tuple[int, bool, int] | None = None  # (reused, take-over, seq_id)
        prompt = tuple(prompt)
        limit = len(prompt) - 1
        for seq_id in reversed(self._entries):  # most recent first: it wins a tie
            held = self._entries[seq_id]
            reused = min(common_prefix(held, prompt), limit)
            take = reused == len(held)
            if reused < self.min_tokens or (self.whole_entries and not take):
                continue
            if best is None or (reused, take) > best[:2]:
                best = (reused, take, seq_id)
        for seq_id, target in self._live.items():
            reused = min(common_prefix(target, prompt), limit)
            if self.whole_entries:  # its state as it stands, or nothing
                written = self._written[seq_id]
                reused = written if reused >= written else 0
            if reused < self.min_tokens:
                continue
            if best is None or reused > best[0]:
                best = (reused, False, seq_id)
        if best is None:
            self.misses += 1
            return None
        reused, take, seq_id = best
        if not take and free_slots < 1 and not self._evictable(spare=seq_id):
            if seq_id not in self._entries or seq_id in self._pins or self.whole_entries:
                self.misses += 1  # no slot for a copy, and the source cannot be rewound
                return None
            take = True  # the only kept entry: continued, rewound to `reused`
        self.hits += 1
        self.reused_tokens += reused
        if take:
            hit = PrefixHit(seq_id, reused, len(self._entries[seq_id]))
            if reused < hit.held:  # rewound: the blocks from the one it writes into are new
                self._inherited[seq_id] = self.blocks_of(seq_id, reused // self.block.tokens)
                self._uid[seq_id] = self._new_uid()
            self._drop(seq_id)
            return hit
        self.copies += 1
        self._pins[seq_id] += 1
        if seq_id in self._entries:
            self._entries.move_to_end(seq_id)  # used: the last to be evicted
            return PrefixHit(seq_id, reused, len(self._entries[seq_id]), copy=True)
        return PrefixHit(seq_id, reused, len(self._live[seq_id]), copy=True)

    def ready(self, hit: PrefixHit, prompt: Sequence[int]) -> bool | None:
        """Whether a planned copy can be made now: True when `hit.seq_id` holds `prompt`'s first
        `hit.reused` tokens in its slot, False while a live source's prefill has yet to reach
        them, None when it never will (the source was released, cut short or rewound: the
        caller prefills the request whole and calls `withdraw`)."""
        want = tuple(prompt[: hit.reused])
        held = self._entries.get(hit.seq_id)
        if held is not None:
            return held[: hit.reused] == want or None
        target = self._live.get(hit.seq_id)
        if target is None or target[: hit.reused] != want:
            return None
        return self._written[hit.seq_id] >= hit.reused

    def done(self, hit: PrefixHit, into: int | None = None) -> None:
        """A planned copy was made (into sequence `into`, which now holds the source's whole
        blocks of the prefix) or given up (`into` None): its source is no longer pinned by it."""
        if into is not None:
            self._inherited[into] = self.blocks_of(hit.seq_id, hit.reused // self.block.tokens)
            self._uid[into] = self._new_uid()
        self._pins[hit.seq_id] -= 1
        if self._pins[hit.seq_id] <= 0:
            del self._pins[hit.seq_id]

    def withdraw(self, hit: PrefixHit) -> None:
        """A planned copy that was not made (`ready` None, or the executor refused it): counted
        as the miss it turned out to be."""
        self.undo(hit)
        self.misses += 1

    def undo(self, hit: PrefixHit | None) -> None:
        """Takes back a `claim` whose request was not admitted after all (no slot could be
        freed: it is claimed again later): neither a hit nor a miss yet. A copy's only."""
        if hit is None:
            self.misses -= 1
            return
        self.done(hit)
        self.hits -= 1
        self.copies -= 1
        self.reused_tokens -= hit.reused

    def pinned(self, seq_id: int) -> bool:
        return seq_id in self._pins

    # ---- slots -------------------------------------------------------------------------------------

    def evict(self, spare: int | None = None) -> int | None:
        """The least recently used kept entry that no planned copy reads (nor `spare`), out of
        the index (the caller releases its sequence); None when there is none."""
        for seq_id in self._entries:
            if seq_id != spare and seq_id not in self._pins:
                self.held_tokens -= len(self._entries.pop(seq_id))
                self._forget_blocks(seq_id)
                self.evictions += 1
                return seq_id
        return None

    def trim(self) -> list[int]:
        """Evicts the least recently used unpinned entries past `max_entries` or `max_bytes`
        (module docstring); their seq_ids (the caller releases them)."""
        out: list[int] = []
        while (self.max_entries is not None and len(self._entries) > self.max_entries) or (
            self.max_bytes is not None and self.cache_bytes() > self.max_bytes
        ):
            seq_id = self.evict()
            if seq_id is None:
                break  # the rest are pinned: trimmed once their copies are made
            out.append(seq_id)
        self._refresh()
        return out

    # ---- blocks ----------------------------------------------------------------------------

    def blocks_of(self, seq_id: int, upto: int | None = None) -> tuple[tuple[int, int], ...]:
        """The blocks (uid, j) `seq_id` holds (module docstring), the first `upto` of them (None:
        as many as its tokens fill, whole or not)."""
        if upto is None:
            held = self._entries.get(seq_id)
            n = len(held) if held is not None else self._written.get(seq_id, 0)
            upto = -(-n // self.block.tokens)
        inherited = self._inherited.get(seq_id, ())[:upto]
        if seq_id not in self._uid:
            self._uid[seq_id] = self._new_uid()
        uid = self._uid[seq_id]
        return inherited + tuple((uid, j) for j in range(len(inherited), upto))

    def held_blocks(self) -> int:
        """Distinct blocks every indexed sequence, kept or live, holds."""
        ids = (*self._entries, *self._live)
        return len({b for i in ids for b in self.blocks_of(i)})

    def cache_bytes(self) -> int:
        """Bytes of the blocks only kept entries hold (no live sequence does), plus each kept
        entry's fixed state: what `max_bytes` bounds."""
        live = {b for i in self._live for b in self.blocks_of(i)}
        kept = {b for i in self._entries for b in self.blocks_of(i)} - live
        return len(kept) * self.block.bytes + len(self._entries) * self.block.entry_bytes

    def _new_uid(self) -> int:
        self._uids += 1
        return self._uids

    def drop_all(self) -> list[int]:
        """Forgets every entry, kept and live (their KV caches are gone, or going); returns the
        kept ones' seq_ids."""
        ids = list(self._entries)
        self._entries.clear()
        self._live.clear()
        self._written.clear()
        self._pins.clear()
        self._uid.clear()
        self._inherited.clear()
        self.held_tokens = 0
        self._refresh()
        return ids

    def stats(self) -> dict[str, int]:
        """Counters and gauges for /metrics and /v1/cluster (the block gauges as of the last
        put, forget, trim or drop)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "copies": self.copies,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "held_tokens": self.held_tokens,
            "held_blocks": self._gauges[0],
            "cache_bytes": self._gauges[1],
        }

    def _refresh(self) -> None:
        """The block gauges `stats` reads (another thread's read sees one pair or the next)."""
        self._gauges = (self.held_blocks(), self.cache_bytes())

    def _evictable(self, spare: int) -> bool:
        return any(i != spare and i not in self._pins for i in self._entries)

    def _drop(self, seq_id: int) -> None:
        tokens = self._entries.pop(seq_id, None)
        if tokens is not None:
            self.held_tokens -= len(tokens)
