"""The prefix cache's index (`tandem.engine.prefix_cache`): longest common prefix, LRU, the
one-token cap, the minimum, and forgetting everything on a replay. Pure bookkeeping, no executor."""

import random

import pytest

from tandem.engine.prefix_cache import PrefixCache, PrefixHit, common_prefix


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


def test_a_prompt_takes_the_entry_it_continues_furthest():
    c = PrefixCache(min_tokens=4)
    system = list(range(100, 120))
    assert c.put(1, system + [1, 2, 3])
    assert c.put(2, system + [7, 8, 9, 10, 11])
    assert c.put(3, [9] * 30)
    hit = c.claim(system + [7, 8, 9, 5, 5, 5])
    assert hit == PrefixHit(seq_id=2, reused=23, held=25)
    assert 2 not in c and len(c) == 2  # taken over by the request, out of the index
    assert c.stats() == {
        "hits": 1,
        "misses": 0,
        "reused_tokens": 23,
        "evictions": 0,
        "entries": 2,
        "held_tokens": 23 + 30,
    }


def test_the_most_recent_of_equal_matches_wins():
    c = PrefixCache(min_tokens=2)
    c.put(1, [1, 2, 3, 4])
    c.put(2, [1, 2, 3, 9])
    assert c.claim([1, 2, 3, 5, 6]).seq_id == 2


def test_at_least_one_prompt_token_is_prefilled():
    c = PrefixCache(min_tokens=4, min_similarity=0.0)
    tokens = list(range(50))
    c.put(7, tokens)
    # the same prompt again, and one that is a prefix of the entry: its last token is prefilled
    assert c.claim(tokens) == PrefixHit(7, 49, 50)
    c.put(7, tokens)
    assert c.claim(tokens[:10]) == PrefixHit(7, 9, 50)


def test_a_reuse_below_the_minimum_is_a_miss_and_keeps_the_entry():
    c = PrefixCache(min_tokens=16, min_similarity=0.0)
    c.put(1, list(range(40)))
    assert c.claim(list(range(15)) + [999] * 10) is None
    assert c.claim(list(range(16))) is None  # 16 shared, but one must be prefilled: 15
    assert 1 in c
    assert c.claim(list(range(17))).reused == 16
    assert (c.hits, c.misses) == (1, 2)


def test_a_prompt_reusing_under_half_an_entry_leaves_that_conversation_alone():
    """A chat template's header and a stock first sentence (20 tokens) do not take over a long
    conversation; a short entry they cover more than half of, they do."""
    header = list(range(200, 220))
    c = PrefixCache(min_tokens=16)  # min_similarity 0.5, llama.cpp's
    c.put(1, header + [1] * 80)  # a long conversation
    assert c.claim(header + [2] * 50) is None and 1 in c
    c.put(2, header + [3] * 15)  # 35 held: 20 reused is more than half
    assert c.claim(header + [2] * 50) == PrefixHit(2, 20, 35)
    assert c.claim(header + [1] * 30 + [4]) == PrefixHit(1, 50, 100)  # exactly half


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
    with pytest.raises(ValueError, match="min_similarity"):
        PrefixCache(min_similarity=1.5)
