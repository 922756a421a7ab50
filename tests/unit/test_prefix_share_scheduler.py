"""Requests sharing a prefix through the scheduler (`tandem.engine.prefix_cache`'s copies) over
the executor double that keeps each sequence's history like a KV cache: concurrent requests with
one system prompt prefill it once and copy it, each answering as it does alone; a copy the
executor refuses, or whose source goes away first, becomes a whole prefill, still right.
Real executors: tests/unit/test_prefix_share_executors.py."""

from _serving_doubles import HistoryExecutor, PipelineHistoryExecutor
from test_prefix_scheduler import GREEDY, SYSTEM, _alone, _drain, _submit

from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.scheduler import Scheduler


def _prefilled(ex) -> int:
    """Prompt tokens the executor was fed in prefill chunks (rows of more than one token)."""
    return sum(len(s.token_ids) for st in ex.steps for s in st.sequences if len(s.token_ids) > 1)


def test_concurrent_requests_sharing_a_system_prompt_prefill_it_once_and_copy_it():
    ex = HistoryExecutor(max_batch=8, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefill_budget=16, prefix_cache=PrefixCache(min_tokens=16))
    prompts = [SYSTEM + [c, c + 1] for c in range(8)]
    outs = [_submit(sched, p, max_tokens=4, **GREEDY) for p in prompts]
    _drain(sched)
    first = ex.steps[0].sequences[0].seq_id
    assert [(src, n) for src, _, n in ex.copies] == [(first, len(SYSTEM))] * 7
    assert [o["request"].cached_tokens for o in outs] == [0] + [len(SYSTEM)] * 7
    # the system prompt once, then each request's own two tokens (one of them the first's)
    assert _prefilled(ex) == len(SYSTEM) + 2 + 7 * 2
    for p, o in zip(prompts, outs):
        assert o["tokens"] == _alone(p, max_tokens=4, **GREEDY)
    stats = sched.prefix_cache.stats()
    assert (stats["hits"], stats["copies"], stats["misses"]) == (7, 7, 1)
    assert stats["reused_tokens"] == 7 * len(SYSTEM)


def test_over_a_pipeline_concurrent_requests_copy_the_shared_prompt():
    ex = PipelineHistoryExecutor(num_stages=2, max_batch=6, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefill_budget=16, prefix_cache=PrefixCache(min_tokens=16))
    prompts = [SYSTEM + [c] * 3 for c in range(6)]
    outs = [_submit(sched, p, max_tokens=5, **GREEDY) for p in prompts]
    _drain(sched)
    assert len(ex.copies) == 5 and ex.max_in_flight == 2
    for p, o in zip(prompts, outs):
        assert o["reason"] == "length"
        assert o["tokens"] == _alone(p, max_tokens=5, **GREEDY)


def test_a_copy_the_executor_refuses_is_prefilled_whole_and_still_right():
    """A hybrid's executor takes only whole copies: the shared part of a running sequence that
    has moved on is refused (`PrefixCopyError`), and the request prefills its prompt whole."""
    ex = HistoryExecutor(max_batch=4, max_seq_len=256, rewind=True, whole_only=True)
    sched = Scheduler(ex, prefill_budget=16, prefix_cache=PrefixCache(min_tokens=16))
    prompts = [SYSTEM + [c] * 3 for c in range(3)]
    outs = [_submit(sched, p, max_tokens=3, **GREEDY) for p in prompts]
    _drain(sched)
    assert ex.copies == []
    for p, o in zip(prompts, outs):
        assert o["request"].cached_tokens == 0
        assert o["tokens"] == _alone(p, max_tokens=3, **GREEDY)
    stats = sched.prefix_cache.stats()
    assert (stats["hits"], stats["copies"], stats["misses"], stats["reused_tokens"]) == (0, 0, 3, 0)


def test_a_copy_whose_source_is_cancelled_first_is_prefilled_whole():
    ex = HistoryExecutor(max_batch=4, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefill_budget=8, prefix_cache=PrefixCache(min_tokens=16))
    a = _submit(sched, SYSTEM + [1], max_tokens=3, **GREEDY)
    b = _submit(sched, SYSTEM + [2], max_tokens=3, **GREEDY)
    sched.step()  # a prefills 8 of its 41 tokens; b waits for them
    a["request"].cancel()
    _drain(sched)
    assert a["reason"] == "cancelled" and ex.copies == []
    assert b["request"].cached_tokens == 0
    assert b["tokens"] == _alone(SYSTEM + [2], max_tokens=3, **GREEDY)
    assert sched.prefix_cache.stats()["copies"] == 0


def test_a_waiting_copy_holds_its_slot_and_the_kept_source_is_never_evicted_under_it():
    """Two slots: a kept conversation, and a request copying its first part. A third request
    needing a slot waits rather than evict the source the copy still reads."""
    ex = HistoryExecutor(max_batch=2, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16))
    conv = SYSTEM + [1] * 10
    _submit(sched, conv, max_tokens=2, **GREEDY)
    _drain(sched)
    b = _submit(sched, SYSTEM + [2], max_tokens=3, **GREEDY)  # a copy into the free slot
    c = _submit(sched, [9] * 20, max_tokens=3, **GREEDY)  # no slot: the source is pinned
    _drain(sched)
    assert b["request"].cached_tokens == len(SYSTEM) and len(ex.copies) == 1
    assert b["tokens"] == _alone(SYSTEM + [2], max_tokens=3, **GREEDY)
    assert c["tokens"] == _alone([9] * 20, max_tokens=3, **GREEDY)
    assert len(ex.history) <= 2
    stats = sched.prefix_cache.stats()  # c's refused admission is counted once, when admitted
    assert (stats["hits"], stats["misses"], stats["copies"]) == (1, 2, 1)


def test_max_entries_keeps_only_that_many_finished_sequences_and_answers_stay_right():
    ex = HistoryExecutor(max_batch=4, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefix_cache=PrefixCache(min_tokens=16, max_entries=1))
    convs = [[c] * 20 for c in (1, 2, 3)]
    outs = []
    for conv in convs:
        outs.append(_submit(sched, conv, max_tokens=3, **GREEDY))
        _drain(sched)
    assert len(sched.prefix_cache) == 1 and len(ex.released) == 2
    for conv, out in reversed(list(zip(convs, outs))):  # only the last kept is continued
        turn = conv + out["tokens"] + [5]
        again = _submit(sched, turn, max_tokens=3, **GREEDY)
        _drain(sched)
        assert again["tokens"] == _alone(turn, max_tokens=3, **GREEDY)
        assert (again["request"].cached_tokens > 0) == (conv is convs[2])


def test_n_choices_of_one_prompt_prefill_it_once_and_copy_it():
    """`n` choices (`server.generation.generate_choices`) are n requests of one prompt submitted
    at once, each on its own seed stream: the first prefills the prompt, the others copy all but
    its last token, and each samples as it does alone."""
    ex = HistoryExecutor(max_batch=4, max_seq_len=256, rewind=True)
    sched = Scheduler(ex, prefill_budget=16, prefix_cache=PrefixCache(min_tokens=16))
    params = [dict(max_tokens=4, temperature=0.9, seed=5, choice=i) for i in range(3)]
    outs = [_submit(sched, SYSTEM, **p) for p in params]
    _drain(sched)
    assert [n for _, _, n in ex.copies] == [len(SYSTEM) - 1] * 2
    for p, o in zip(params, outs):
        assert o["tokens"] == _alone(SYSTEM, **p)
