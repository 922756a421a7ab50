"""The prefix cache over a hybrid model (Qwen3.5's Gated DeltaNet layers, whose recurrent state
cannot be rewound): an entry is reused only at its end. Over the real single-node executor of
tiny-qwen35, the next turn of a conversation continues its sequence from the state it holds and
answers as a fresh run does; a prompt that parts from an entry early is a miss, prefilled in a
fresh slot (no rewind reaches the executor), and answers as a fresh run does."""

import threading

import torch

from tandem.engine.local import LocalExecutor
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, Scheduler
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset, random_weights

SYSTEM = [(7 * i + 3) % 500 + 1 for i in range(24)]


def test_a_whole_entries_cache_reuses_an_entry_only_at_its_end():
    cache = PrefixCache(min_tokens=4, whole_entries=True)
    cache.put(1, [1, 2, 3, 4, 5, 6])
    assert cache.claim([1, 2, 3, 4, 5, 9, 9]) is None  # parts at 5 of 6: a rewind
    assert cache.claim([1, 2, 3, 4, 5, 6]) is None  # all of it, but one token must be prefilled
    hit = cache.claim([1, 2, 3, 4, 5, 6, 7])
    assert (hit.seq_id, hit.reused, hit.held) == (1, 6, 6)


def _executor() -> LocalExecutor:
    c = get_preset("tiny-qwen35").config
    m = Transformer(c)
    m.load_state_dict(random_weights(c, 11, torch.float32))
    return LocalExecutor(m.eval(), max_batch=3, max_seq_len=128)


def _run(sched: Scheduler, prompt: list[int], n: int) -> tuple[list[int], Request]:
    tokens: list[int] = []
    done = threading.Event()
    req = Request(list(prompt), SamplingParams(max_tokens=n, temperature=0), tokens.append,
                  lambda reason, err: done.set())  # fmt: skip
    sched.submit(req)
    while sched.step():
        pass
    assert done.is_set()
    return tokens, req


def test_a_hybrid_conversation_continues_its_state_and_a_parting_prompt_starts_fresh():
    ex = _executor()
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=8, whole_entries=True))
    turn1 = SYSTEM + [1, 2, 3]
    a, _ = _run(sched, turn1, 6)
    turn2 = turn1 + a + [4, 5]
    b, req = _run(sched, turn2, 5)
    assert req.cached_tokens == len(turn1) + len(a) - 1  # the last sampled token was never fed
    parted = SYSTEM + [9, 9]
    c, req_c = _run(sched, parted, 5)
    assert req_c.cached_tokens == 0
    stats = sched.prefix_cache.stats()
    assert (stats["hits"], stats["misses"]) == (1, 2)
    fresh = Scheduler(_executor())
    assert b == _run(fresh, turn2, 5)[0]
    assert c == _run(fresh, parted, 5)[0]


def test_two_next_turns_at_once_one_continues_the_state_the_other_copies_it_whole():
    """Two requests continue one kept conversation at once (a regenerated answer beside the
    original): the first takes the sequence over, the second gets its recurrent state and KV
    copied whole before either moves on; both answer as fresh runs do."""
    ex = _executor()
    cache = PrefixCache(min_tokens=8, whole_entries=True)
    sched = Scheduler(ex, prefix_cache=cache)
    turn1 = SYSTEM + [1, 2, 3]
    a, _ = _run(sched, turn1, 6)
    held = len(turn1) + len(a) - 1
    turns = [turn1 + a + [4, 5], turn1 + a + [6]]
    outs: list[list[int]] = [[], []]
    reqs = [
        sched.submit(Request(list(t), SamplingParams(max_tokens=5, temperature=0), o.append,
                             lambda reason, err: None))
        for t, o in zip(turns, outs)
    ]  # fmt: skip
    while sched.step():
        pass
    assert [r.cached_tokens for r in reqs] == [held, held]
    assert cache.stats()["copies"] == 1
    fresh = Scheduler(_executor())
    for t, o in zip(turns, outs):
        assert o == _run(fresh, t, 5)[0]
