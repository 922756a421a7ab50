"""The scheduler with a prefix cache over an executor double that keeps each sequence's history
like a KV cache (its logits depend on every token it holds, so a continuation that claimed a
token the executor does not hold changes the output): what the first step of a continued prompt
is, what is kept, evicted and forgotten, and that every output equals the run without a cache.
The same over real executors on tiny GGUF files is in tests/unit/test_prefix_executors.py."""

import random
import threading

from _serving_doubles import HistoryExecutor, PipelineHistoryExecutor
from test_recovery import BreakingExecutor

from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.recovery import RecoveringExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, Scheduler

GREEDY = dict(temperature=0)
SYSTEM = [(7 * i + 3) % 50 for i in range(40)]  # a "system prompt" every conversation shares


def _submit(sched, prompt, **params):
    out: dict = {"tokens": [], "reason": None}
    done = threading.Event()

    def on_finish(reason, err):
        out["reason"], out["error"] = reason, err
        done.set()

    req = Request(list(prompt), SamplingParams(**params), out["tokens"].append, on_finish)
    sched.submit(req)
    out["request"] = req
    return out


def _drain(sched):
    while sched.step():
        pass


def _alone(prompt, **params):
    """The tokens `prompt` gets on a fresh scheduler without a prefix cache."""
    sched = Scheduler(HistoryExecutor(max_seq_len=256))
    out = _submit(sched, prompt, **params)
    _drain(sched)
    return out["tokens"]


def test_the_next_turn_prefills_only_what_follows_the_tokens_held():
    ex = HistoryExecutor(max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    turn1 = SYSTEM + [1, 2, 3]
    a = _submit(sched, turn1, max_tokens=6, **GREEDY)
    _drain(sched)
    assert a["reason"] == "length" and ex.released == []  # kept, not released
    # held: the prompt and the generated tokens that were fed (the last one never was)
    held = turn1 + a["tokens"][:-1]
    assert sched.prefix_cache.stats()["held_tokens"] == len(held)
    turn2 = turn1 + a["tokens"] + [4, 5]
    n_steps = len(ex.steps)
    b = _submit(sched, turn2, max_tokens=5, **GREEDY)
    _drain(sched)
    (first,) = ex.steps[n_steps].sequences
    assert first.seq_id == ex.steps[0].sequences[0].seq_id  # a's sequence, taken over
    assert first.start_pos == len(held) and first.token_ids == tuple(turn2[len(held) :])
    assert b["request"].cached_tokens == len(held)
    assert b["tokens"] == _alone(turn2, max_tokens=5, **GREEDY)
    stats = sched.prefix_cache.stats()
    assert (stats["hits"], stats["misses"], stats["reused_tokens"]) == (1, 1, len(held))


def test_a_prompt_that_parts_early_copies_the_shared_part_and_is_still_right():
    ex = HistoryExecutor(max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    _submit(sched, SYSTEM + [1, 2, 3, 4, 5, 6], max_tokens=8, **GREEDY)
    _drain(sched)
    n_steps = len(ex.steps)
    other = SYSTEM + [9, 9]  # a different first question after the same system prompt
    b = _submit(sched, other, max_tokens=4, **GREEDY)
    _drain(sched)
    (first,) = ex.steps[n_steps].sequences
    assert first.start_pos == len(SYSTEM) and first.token_ids == (9, 9)
    assert ex.copies == [(ex.steps[0].sequences[0].seq_id, first.seq_id, len(SYSTEM))]
    assert b["tokens"] == _alone(other, max_tokens=4, **GREEDY)
    assert len(sched.prefix_cache) == 2  # the first conversation is kept whole beside it


def test_the_same_prompt_again_prefills_its_last_token():
    ex = HistoryExecutor(max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    a = _submit(sched, SYSTEM, max_tokens=3, **GREEDY)
    _drain(sched)
    n_steps = len(ex.steps)
    b = _submit(sched, SYSTEM, max_tokens=3, **GREEDY)
    _drain(sched)
    (first,) = ex.steps[n_steps].sequences
    assert first.start_pos == len(SYSTEM) - 1 and first.token_ids == (SYSTEM[-1],)
    assert b["tokens"] == a["tokens"]


def test_a_short_common_prefix_takes_a_fresh_slot_and_leaves_the_entry():
    ex = HistoryExecutor(max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    _submit(sched, SYSTEM, max_tokens=3, **GREEDY)
    _drain(sched)
    b = _submit(sched, SYSTEM[:10] + [1] * 20, max_tokens=3, **GREEDY)
    _drain(sched)
    assert b["request"].cached_tokens == 0
    assert len(sched.prefix_cache) == 2 and len(ex.history) == 2


def test_without_a_free_slot_the_least_recently_kept_sequence_is_released():
    ex = HistoryExecutor(max_batch=2, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    convs = [[c] * 20 for c in (1, 2, 3)]
    outs = []
    for conv in convs:  # three conversations one after another over two slots
        outs.append(_submit(sched, conv, max_tokens=3, **GREEDY))
        _drain(sched)
    first_ids = [s.sequences[0].seq_id for s in ex.steps if s.sequences[0].start_pos == 0]
    assert ex.released == [first_ids[0]]  # the third needed a slot: the first went
    assert sched.prefix_cache.evictions == 1
    # conversation 1 comes back: prefilled whole, right; conversation 3 is continued
    back = _submit(sched, convs[0] + outs[0]["tokens"] + [5], max_tokens=3, **GREEDY)
    _drain(sched)
    assert back["request"].cached_tokens == 0
    cont = _submit(sched, convs[2] + outs[2]["tokens"] + [5], max_tokens=3, **GREEDY)
    _drain(sched)
    assert cont["request"].cached_tokens == 20 + 2
    for out, prompt in ((back, convs[0] + outs[0]["tokens"] + [5]),
                        (cont, convs[2] + outs[2]["tokens"] + [5])):  # fmt: skip
        assert out["tokens"] == _alone(prompt, max_tokens=3, **GREEDY)


def test_kept_sequences_never_take_a_slot_a_running_request_needs():
    ex = HistoryExecutor(max_batch=3, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    for c in (1, 2, 3):
        _submit(sched, [c] * 20, max_tokens=2, **GREEDY)
    _drain(sched)
    assert len(sched.prefix_cache) == 3  # every slot holds a kept sequence
    prompts = [[c] * 18 + [9, 9, 9] for c in (4, 5, 6)]
    outs = [_submit(sched, p, max_tokens=4, **GREEDY) for p in prompts]
    _drain(sched)  # three at once: all three kept sequences evicted, none continued
    assert max(len(s.sequences) for s in ex.steps) == 3
    assert sched.prefix_cache.evictions == 3
    for out, p in zip(outs, prompts):
        assert out["tokens"] == _alone(p, max_tokens=4, **GREEDY)


def test_random_chats_with_and_without_the_cache_give_the_same_tokens():
    """Conversations sharing system prompts, turns submitted in random waves over 1-4 slots,
    greedy and seeded sampling: every turn's tokens equal a run without the cache, and the double
    (which refuses more sequences than slots) holds each continued token."""
    rng = random.Random(7)
    hits = evictions = 0
    systems = [[rng.randrange(50) for _ in range(rng.randrange(10, 40))] for _ in range(3)]
    for trial in range(12):
        max_batch = rng.randrange(1, 5)
        ex = HistoryExecutor(max_batch=max_batch, max_seq_len=512, rewind=True)
        cache = PrefixCache(min_tokens=rng.choice([1, 4, 16]))
        sched = Scheduler(ex, prefix_cache=cache)
        chats = [list(rng.choice(systems)) for _ in range(rng.randrange(2, 6))]
        reused = 0
        for _ in range(4):  # turns
            wave = rng.sample(range(len(chats)), rng.randrange(1, len(chats) + 1))
            outs = []
            for c in wave:
                chats[c] += [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
                params = dict(max_tokens=rng.randrange(1, 6), temperature=0)
                if rng.random() < 0.5:
                    params = dict(max_tokens=params["max_tokens"], temperature=0.9, seed=c)
                outs.append((c, list(chats[c]), params, _submit(sched, chats[c], **params)))
            _drain(sched)
            for c, prompt, params, out in outs:
                assert out["reason"] == "length", trial
                assert out["tokens"] == _alone(prompt, **params), trial
                reused += out["request"].cached_tokens
                chats[c] += out["tokens"]
            assert len(ex.history) <= max_batch
        assert reused == sched.prefix_cache.reused_tokens
        hits += sched.prefix_cache.hits
        evictions += sched.prefix_cache.evictions
    assert hits >= 20 and evictions >= 5  # the trials did continue and evict


def test_a_cancelled_request_keeps_what_it_prefilled():
    ex = HistoryExecutor(max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    a = _submit(sched, SYSTEM, max_tokens=50, **GREEDY)
    for _ in range(3):  # prefill and two decode steps
        sched.step()
    a["request"].cancel()
    sched.step()
    assert a["reason"] == "cancelled" and ex.released == []
    assert sched.prefix_cache.stats()["held_tokens"] == len(SYSTEM) + 2
    turn = SYSTEM + a["tokens"] + [3]
    b = _submit(sched, turn, max_tokens=3, **GREEDY)
    _drain(sched)
    assert b["request"].cached_tokens == len(SYSTEM) + 2
    assert b["tokens"] == _alone(turn, max_tokens=3, **GREEDY)


def test_a_replay_forgets_the_kept_sequences_and_prefills_whole():
    """The group breaks while idle and re-forms empty; a request that claimed a kept sequence
    before the scheduler knew is replayed from position 0, reports no cached tokens, and the
    index starts again from what the new group holds."""
    built = []

    def build(epoch):
        ex = BreakingExecutor(epoch, max_seq_len=256, rewind=True)
        built.append(ex)
        return ex

    ex = RecoveringExecutor(build(0), build, deadline_s=10, poll_s=0.02)
    try:
        sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
        a = _submit(sched, SYSTEM + [1], max_tokens=4, **GREEDY)
        other = _submit(sched, [5] * 20, max_tokens=4, **GREEDY)
        _drain(sched)
        assert len(sched.prefix_cache) == 2
        built[0].kill()  # idle: the scheduler learns of it at its next step
        turn = SYSTEM + [1] + a["tokens"] + [2]
        b = _submit(sched, turn, max_tokens=4, **GREEDY)
        _drain(sched)
        assert len(built) == 2 and sched.stats.replayed_sequences == 1
        (first,) = built[1].steps[0].sequences
        assert first.start_pos == 0 and first.token_ids == tuple(turn)
        assert b["request"].cached_tokens == 0
        assert b["tokens"] == _alone(turn, max_tokens=4, **GREEDY)
        # the other kept sequence went with the old group: its next turn is prefilled whole
        again = [5] * 20 + other["tokens"] + [1]
        d = _submit(sched, again, max_tokens=3, **GREEDY)
        _drain(sched)
        assert d["reason"] == "length" and d["request"].cached_tokens == 0
        assert d["tokens"] == _alone(again, max_tokens=3, **GREEDY)
        # what b left in the new group is kept and continued
        c = _submit(sched, turn + b["tokens"] + [3], max_tokens=2, **GREEDY)
        _drain(sched)
        assert c["request"].cached_tokens == len(turn) + 3
    finally:
        ex.close()


def test_an_executor_failure_forgets_the_kept_sequences():
    ex = HistoryExecutor(max_seq_len=256, rewind=True, fail_after=3)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    _submit(sched, SYSTEM, max_tokens=1, **GREEDY)
    _drain(sched)
    assert len(sched.prefix_cache) == 1
    out = _submit(sched, SYSTEM + [1], max_tokens=5, **GREEDY)
    _drain(sched)
    assert out["reason"] == "error" and len(sched.prefix_cache) == 0


def test_over_a_pipeline_continued_prompts_give_the_same_tokens():
    ex = PipelineHistoryExecutor(num_stages=2, max_batch=4, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    firsts = [_submit(sched, SYSTEM + [c], max_tokens=3, **GREEDY) for c in range(4)]
    _drain(sched)
    turns = [SYSTEM + [c] + firsts[c]["tokens"] + [9] for c in range(4)]
    outs = [_submit(sched, t, max_tokens=3, **GREEDY) for t in turns]
    _drain(sched)
    assert ex.max_in_flight == 2
    for t, out in zip(turns, outs):
        assert out["request"].cached_tokens >= len(SYSTEM)
        assert out["tokens"] == _alone(t, max_tokens=3, **GREEDY)
