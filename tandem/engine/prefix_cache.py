"""The prefix cache's index on the head: which finished sequences the executor still holds, by
their tokens, and which of them a new prompt continues. Pure bookkeeping (no torch, no executor);
the scheduler drives it (`tandem.engine.scheduler`).

The design is llama.cpp server's slots with `cache_prompt`, not paged blocks. Every executor keeps
a sequence's KV cache in a preallocated slot until `release`; a finished request's sequence is
kept instead of released, as an entry: its seq_id and the tokens whose keys and values are in its
slot (prompt + generated tokens that were fed; the last sampled token never was). A new request
takes over the entry whose tokens share the longest common prefix with its prompt, p tokens,
and prefills only `prompt[p:]` from position p: a step whose `start_pos` is behind the cached
length rewinds the sequence, which every executor takes (`SequenceCache`'s rule).

    reuse  p = min(common prefix, len(prompt) - 1)   at least one token is prefilled: its logits
                                                     give the first sampled token
    a hit  p >= min_tokens and                       else the request takes a fresh slot and
           p >= min_similarity * held                leaves the entries for prompts they fit

The second bound is llama.cpp's `--slot-prompt-similarity` (0.5 there too): a prompt that shares
only a chat template's header and a stock first sentence with a long conversation must not take
that conversation's slot over and throw away the rest of it; the longest reuse among the entries
that pass both bounds wins.

Tokens, not messages, are matched, so a chat template that renders earlier turns differently
still reuses the common part. An entry holds one of the executor's `max_batch` slots: when a new
request finds no free slot, the least recently kept entry goes (`evict`; the caller releases its
sequence). Its limits: one request at a time continues an entry (concurrent requests that share
a system prompt each prefill it), and an entry is reused only from its head.

A hybrid model (Qwen3.5's Gated DeltaNet layers) holds a recurrent state per sequence, which
cannot be rewound to an earlier position (`engine.sequences.RecurrentRewindError`): with
`whole_entries` an entry is reused only exactly at its end, p = held, by a prompt that continues
all of its tokens (the next turn of the same conversation); any shorter match is a miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MIN_TOKENS = 16
DEFAULT_MIN_SIMILARITY = 0.5

__all__ = [
    "DEFAULT_MIN_SIMILARITY",
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
class PrefixHit:
    """A request's claim on an entry: sequence `seq_id` holds `held` tokens, of which the first
    `reused` are the request's prompt's; its first step starts at position `reused`."""

    seq_id: int
    reused: int
    held: int


class PrefixCache:
    """Entries (seq_id -> tokens held), least recently kept first. Not thread-safe: one owner
    (the scheduler's thread) mutates it; `stats` reads only counters, safe from any thread."""

    def __init__(
        self,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        min_similarity: float = DEFAULT_MIN_SIMILARITY,
        whole_entries: bool = False,
    ) -> None:
        """`whole_entries`: reuse an entry only at its end (a hybrid model, module docstring)."""
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        if not 0.0 <= min_similarity <= 1.0:
            raise ValueError(f"min_similarity is a share in [0, 1], got {min_similarity}")
        self.min_tokens = min_tokens
        self.min_similarity = min_similarity
        self.whole_entries = whole_entries
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.hits = 0  # requests that continued an entry
        self.misses = 0  # requests that found none worth continuing
        self.reused_tokens = 0  # prompt tokens not prefilled, summed over hits
        self.evictions = 0
        self.held_tokens = 0  # tokens the entries hold now

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def put(self, seq_id: int, tokens: Sequence[int]) -> bool:
        """Keeps `seq_id`, whose slot holds `tokens` at positions 0.., as the most recent entry.
        False (nothing kept: the caller releases it) where it is too short ever to be a hit."""
        self._drop(seq_id)
        if len(tokens) < self.min_tokens:
            return False
        self._entries[seq_id] = tuple(tokens)
        self.held_tokens += len(tokens)
        return True

    def claim(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The entry `prompt` continues furthest (the most recent of equals) among those whose
        reuse reaches `min_tokens` and `min_similarity` of what they hold, taken out of the index
        for the request to continue; None (a miss) where there is none."""
        best: PrefixHit | None = None
        prompt = tuple(prompt)
        limit = len(prompt) - 1
        for seq_id in reversed(self._entries):  # most recent first: it wins a tie
            held = self._entries[seq_id]
            reused = min(common_prefix(held, prompt), limit)
            if reused < max(self.min_tokens, self.min_similarity * len(held)):
                continue
            if self.whole_entries and reused != len(held):
                continue
            if best is None or reused > best.reused:
                best = PrefixHit(seq_id, reused, len(held))
        if best is None:
            self.misses += 1
            return None
        self._drop(best.seq_id)
        self.hits += 1
        self.reused_tokens += best.reused
        return best

    def evict(self) -> int | None:
        """The least recently kept entry's seq_id, out of the index (the caller releases its
        sequence); None when there is none."""
        if not self._entries:
            return None
        seq_id, tokens = self._entries.popitem(last=False)
        self.held_tokens -= len(tokens)
        self.evictions += 1
        return seq_id

    def drop_all(self) -> list[int]:
        """Forgets every entry (their KV caches are gone, or going); returns their seq_ids."""
        ids = list(self._entries)
        self._entries.clear()
        self.held_tokens = 0
        return ids

    def stats(self) -> dict[str, int]:
        """Counters and gauges for /metrics and /v1/cluster."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "held_tokens": self.held_tokens,
        }

    def _drop(self, seq_id: int) -> None:
        tokens = self._entries.pop(seq_id, None)
        if tokens is not None:
            self.held_tokens -= len(tokens)
