"""The prefix cache's index (`tandem.engine.prefix_cache`): longest common prefix, take-over or
copy, copies from running sequences once written, pins, LRU, the one-token cap, the minimum,
forgetting everything on a replay, and the blocks sequences share and `max_bytes` bounds. Pure bookkeeping, no executor."""

import random

import pytest

from tandem.engine.prefix_cache import BlockSize, PrefixCache, PrefixHit, common_prefix


def test_common_prefix_counts_shared_leading_tokens_of_lists_and_tuples():
    assert common_prefix([1, 2, 3], (1, 2, 3, 4)) == 3
    assert common_prefix((1, 2, 3), [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [6]) == 0
    rng = random.Random(0)
    for _ in range(500):  # the binary search against the plain loop
        n = rng.randrange(0, 60)
        a = [rng.randrange(3) for _ in range(n)]
        b = a[: rng.randrange(0, n + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 9))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == want


def test_a_prompt_copies_the_entry_it_continues_furthest_and_takes_over_an_exact_one():
    c = PrefixCache(min_tokens=4)
    system = list(range(100, 120))
    assert c.put(1, system + [1, 2, 3])
    assert c.put(2, system + [7, 8, 9, 10, 11])
    assert c.put(3, [9] * 30)
    hit = c.claim(system + [7, 8, 9, 5, 5, 5])  # parts from entry 2 before its end: a copy
    assert hit == PrefixHit(seq_id=2, reused=23, held=25, copy=True)
    assert 2 in c and len(c) == 3 and c.pinned(2)  # the entry stays, for others
    c.done(hit)
    assert c.stats() == {
        "hits": 1,
        "misses": 0,
        "reused_tokens": 23,
        "copies": 1,
        "evictions": 0,
        "entries": 3,
        "held_tokens": 23 + 25 + 30,
        "held_blocks": 2 + 2 + 2,  # 16 tokens a block (the default), none shared
        "cache_bytes": 0,  # a block's bytes unknown (the default)
    }
    hit = c.claim(system + [7, 8, 9, 10, 11, 12])  # continues all of entry 2: the next turn
    assert hit == PrefixHit(seq_id=2, reused=25, held=25)
    assert 2 not in c and len(c) == 2 and c.held_tokens == 23 + 30


def test_the_most_recent_of_equal_matches_wins_and_a_take_over_beats_a_copy():
    c = PrefixCache(min_tokens=2)
    c.put(1, [1, 2, 3, 4])
    c.put(2, [1, 2, 3, 9])
    assert c.claim([1, 2, 3, 5, 6]).seq_id == 2
    c.put(3, [1, 2, 3])  # most recent of the three: all 3 reused, and it ends there
    c.put(4, [1, 2, 3, 7])
    assert c.claim([1, 2, 3, 5]) == PrefixHit(3, 3, 3)


def test_at_least_one_prompt_token_is_prefilled():
    c = PrefixCache(min_tokens=4)
    tokens = list(range(50))
    c.put(7, tokens)
    # the same prompt again, and one that is a prefix of the entry: its last token is prefilled
    assert c.claim(tokens) == PrefixHit(7, 49, 50, copy=True)
    assert c.claim(tokens[:10]) == PrefixHit(7, 9, 50, copy=True)


def test_a_reuse_below_the_minimum_is_a_miss_and_keeps_the_entry():
    c = PrefixCache(min_tokens=16)
    c.put(1, list(range(40)))
    assert c.claim(list(range(15)) + [999] * 10) is None
    assert c.claim(list(range(16))) is None  # 16 shared, but one must be prefilled: 15
    assert 1 in c
    assert c.claim(list(range(17))).reused == 16
    assert (c.hits, c.misses) == (1, 2)


def test_a_prompt_parting_early_copies_and_leaves_the_conversation_whole():
    """A chat template's header and a stock first sentence (20 tokens) are copied out of a long
    conversation, which stays whole for its own next turn."""
    header = list(range(200, 220))
    c = PrefixCache(min_tokens=16)
    c.put(1, header + [1] * 80)  # a long conversation
    hit = c.claim(header + [2] * 50)
    assert hit == PrefixHit(1, 20, 100, copy=True) and c._entries[1] == tuple(header + [1] * 80)
    c.done(hit)
    assert c.claim(header + [1] * 80 + [4]) == PrefixHit(1, 100, 100)


def test_without_a_free_slot_a_copy_needs_another_entry_to_evict_or_takes_its_source_over():
    header = list(range(200, 220))
    c = PrefixCache(min_tokens=16)
    c.put(1, header + [1] * 80)
    # no free slot, the source the only kept entry: taken over, rewound to where the prompt parts
    assert c.claim(header + [2] * 5, free_slots=0) == PrefixHit(1, 20, 100)
    c.put(1, header + [1] * 80)
    c.put(2, [5] * 20)
    hit = c.claim(header + [2] * 5, free_slots=0)  # entry 2 can go: a copy
    assert hit.copy and c.evict(spare=hit.seq_id) == 2
    # the source pinned by that copy, no slot and nothing to evict: a miss, the source stays
    assert c.claim(header + [3] * 5, free_slots=0) is None and 1 in c
    c.done(hit)
    assert not c.pinned(1) and c.evict() == 1


def test_a_running_sequence_is_copied_once_its_prefill_reaches_the_shared_part():
    system = list(range(300, 340))
    c = PrefixCache(min_tokens=16)
    c.track(5, system + [1, 2], written=0)  # the first request, not yet prefilled
    hit = c.claim(system + [3, 4])  # a concurrent one with the same system prompt
    assert hit == PrefixHit(5, 40, 42, copy=True)
    assert c.ready(hit, system + [3, 4]) is False
    c.advance(5, 32)
    assert c.ready(hit, system + [3, 4]) is False
    c.advance(5, 42)
    assert c.ready(hit, system + [3, 4]) is True
    c.done(hit)
    # a source released before the copy (a cancelled request): never; counted as a miss
    hit = c.claim(system + [7])
    c.forget(5)
    assert c.ready(hit, system + [7]) is None
    c.withdraw(hit)
    assert c.stats()["hits"] == 1 and c.stats()["misses"] == 1 and c.stats()["copies"] == 1
    assert c.reused_tokens == 40


def test_a_kept_source_rewound_by_a_take_over_is_copied_only_if_it_still_holds_the_prefix():
    c = PrefixCache(min_tokens=4)
    c.put(1, list(range(30)))
    hit = c.claim(list(range(20)) + [99])  # a copy of 20 planned
    c.track(1, list(range(10)) + [50] * 5, written=10)  # the entry's sequence rewound to 10
    assert c.ready(hit, list(range(20)) + [99]) is None


def test_a_busy_entry_is_copied_from_not_taken_over():
    c = PrefixCache(min_tokens=4)
    turn = list(range(40))
    c.put(1, turn)
    first = c.claim(turn + [1])  # the next turn takes the entry over ...
    assert first == PrefixHit(1, 40, 40)
    c.track(1, turn + [1], written=40)
    second = c.claim(turn + [2])  # ... and a regenerated next turn copies it
    assert second == PrefixHit(1, 40, 41, copy=True)
    assert c.ready(second, turn + [2]) is True


def test_a_whole_entries_cache_copies_a_live_sequence_only_at_its_length():
    c = PrefixCache(min_tokens=4, whole_entries=True)
    c.track(1, list(range(30)), written=25)
    assert c.claim(list(range(20)) + [5]) is None  # 20 of the 25 its state holds: no cut
    c.track(1, list(range(30)), written=12)
    hit = c.claim(list(range(20)) + [5])  # all 12 it holds so far, state as it stands
    assert hit == PrefixHit(1, 12, 30, copy=True) and c.ready(hit, list(range(20)) + [5])
    c.put(2, list(range(100, 130)))
    assert c.claim(list(range(100, 120)) + [5]) is None  # a kept entry in part: never


def test_an_entry_too_short_ever_to_be_a_hit_is_not_kept():
    c = PrefixCache(min_tokens=16)
    assert not c.put(1, list(range(15)))
    assert len(c) == 0 and c.held_tokens == 0
    assert c.put(1, list(range(16)))


def test_eviction_takes_the_least_recently_kept_entry():
    c = PrefixCache(min_tokens=1)
    for sid in (1, 2, 3):
        c.put(sid, [sid] * 5)
    c.put(1, [1] * 6)  # kept again: now the most recent
    assert c.evict() == 2
    assert c.evict() == 3
    assert c.evict() == 1
    assert c.evict() is None
    assert c.evictions == 3 and c.held_tokens == 0


def test_a_continued_entry_kept_again_is_the_most_recent():
    c = PrefixCache(min_tokens=2)
    c.put(1, [1, 1, 1])
    c.put(2, [2, 2, 2])
    hit = c.claim([1, 1, 1, 4])
    c.put(hit.seq_id, [1, 1, 1, 4, 5])
    assert c.evict() == 2


def test_a_replay_forgets_every_entry():
    c = PrefixCache(min_tokens=1)
    c.put(4, [1, 2])
    c.put(5, [3, 4])
    assert sorted(c.drop_all()) == [4, 5]
    assert len(c) == 0 and c.held_tokens == 0
    assert c.claim([1, 2, 3]) is None
    assert c.evict() is None


def test_held_tokens_follow_every_change():
    rng = random.Random(1)
    c = PrefixCache(min_tokens=3)
    for _ in range(300):
        op = rng.randrange(4)
        if op == 0:
            c.put(rng.randrange(6), [rng.randrange(3) for _ in range(rng.randrange(10))])
        elif op == 1:
            c.claim([rng.randrange(3) for _ in range(rng.randrange(1, 10))])
        elif op == 2:
            c.evict()
        else:
            c._drop(rng.randrange(6))
        assert c.held_tokens == sum(len(t) for t in c._entries.values())


def test_the_bounds_are_checked():
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixCache(min_tokens=0)


def test_max_entries_bounds_the_kept_entries_least_recently_used_first():
    c = PrefixCache(min_tokens=2, max_entries=2)
    for sid in (1, 2, 3):
        assert c.put(sid, [sid] * 5)
    assert c.trim() == [1] and len(c) == 2 and c.evictions == 1
    hit = c.claim([2] * 4 + [7])  # a copy from 2 pins it and makes it the most recent
    c.put(4, [4] * 5)
    assert c.trim() == [3]  # 2 is pinned: the next least recently used goes
    c.done(hit)
    assert PrefixCache(min_tokens=2, max_entries=0).put(1, [1] * 5) is False
    with pytest.raises(ValueError, match="max_entries"):
        PrefixCache(max_entries=-1)


def test_a_copy_shares_the_sources_whole_blocks_and_max_bytes_counts_each_once():
    """Blocks of 10 tokens, 100 bytes each: a copy of 35 tokens shares 3 blocks; `cache_bytes`
    counts a kept entry's blocks that no running sequence holds, a shared one once."""
    c = PrefixCache(min_tokens=4, block=BlockSize(10, 100), max_bytes=1100)
    system = list(range(1000, 1040))
    assert c.put(1, system)  # 4 blocks
    hit = c.claim(system[:35] + [5] * 20)  # parts at 35: a copy of 3 whole blocks
    assert hit.copy and hit.reused == 35
    c.track(7, system[:35] + [5] * 20)
    c.done(hit, into=7)
    c.advance(7, 55)  # 3 shared + its own blocks 3..5
    assert c.blocks_of(7)[:3] == c.blocks_of(1)[:3]
    assert c.held_blocks() == 4 + 3
    assert c.cache_bytes() == 100  # entry 1's 4th block only: the 3 shared ones are live
    assert c.put(7, system[:35] + [5] * 20)  # finished, kept
    assert c.cache_bytes() == 700 and c.trim() == []
    c.put(2, [9] * 45)  # 5 more blocks: 1200 bytes, past 1100
    assert c.trim() == [1]  # the least recently used goes: its 3 shared blocks stay with 7
    assert c.stats()["cache_bytes"] == 600 + 500 and c.stats()["held_blocks"] == 11


def test_a_take_over_that_rewinds_writes_new_blocks_from_the_one_it_cuts():
    c2 = PrefixCache(min_tokens=4, block=BlockSize(10, 100))
    c2.put(1, list(range(40)))
    before = c2.blocks_of(1)
    hit = c2.claim(list(range(25)) + [99] * 5, free_slots=0)  # the only entry: rewound
    assert hit == PrefixHit(seq_id=1, reused=25, held=40)
    c2.track(1, list(range(25)) + [99] * 5, 25)
    c2.advance(1, 30)
    after = c2.blocks_of(1)
    assert after[:2] == before[:2] and after[2] != before[2]  # block 2 copied on write
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)
