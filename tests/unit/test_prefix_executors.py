"""The prefix cache over real executors on tiny GGUF files (tiny-qwen3's shape, a 512-token
byte-level BPE, 2048 positions): a chat's next turn continued from the kept sequence against the
same turn prefilled by a fresh executor.

Bit equality of a continuation rests on batch-invariant kernels (csrc/canon.h, the native
attention): the kept KV of the previous turn's generated tokens was written by decode steps and a
fresh prefill writes it in one product of many rows, and both must give the same bits.
"""

import dataclasses

import numpy as np
import pytest

from tandem.engine.executor import Step, StepSequence
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, Scheduler
from tandem.kernels import native
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

BUDGET = 128  # the scheduler's prefill chunk: turn 1 and a fresh turn 2 go in several
CASES = [
    pytest.param("lean", "BF16", id="lean-BF16"),
    pytest.param("lean", "Q8_0", id="lean-Q8_0"),
    pytest.param("lean", "Q4_1", id="lean-Q4_1"),
    pytest.param("local", "Q8_0", id="local-Q8_0"),
    pytest.param("local", "F32", id="local-F32"),
]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cfg = dataclasses.replace(get_preset("tiny-qwen3").config, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("prefix")
    made = {}
    for qtype in ("BF16", "Q8_0", "Q4_1", "F32"):
        _, (f,) = write_preset_gguf(out / f"tiny-{qtype}.gguf", "tiny-qwen3", qtype, config=cfg)
        made[qtype] = f
    return made


def _executor(kind: str, f, max_batch: int = 2):
    if kind == "lean":
        from tandem.engine.lean import LeanExecutor

        return LeanExecutor.from_file(f, max_batch=max_batch, max_seq_len=1024, threads=2)
    from tandem.engine.local import LocalExecutor

    return LocalExecutor.from_dir(f, max_batch=max_batch, max_seq_len=1024)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _generate(sched: Scheduler, prompt: list[int], n: int) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy request run to its end."""
    tokens: list[int] = []
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    req = sched.submit(Request(list(prompt), params, tokens.append, lambda r, e: None))
    while sched.step():
        pass
    return tokens, req.cached_tokens


def _logits(ex, steps) -> np.ndarray:
    out = None
    for sid, toks, pos in steps:
        out = ex.run(Step((StepSequence(sid, tuple(toks), pos),))).logits
    return np.asarray(out)


@pytest.mark.parametrize(("n_gen", "budget"), [(12, 128), (48, 64)])
@pytest.mark.parametrize(("kind", "qtype"), CASES)
def test_a_prefill_continued_from_kept_kv_equals_a_fresh_prefill_bit_for_bit(
    files, kind, qtype, n_gen, budget
):
    """Turn 1 prefilled in chunks then decoded token by token; turn 2 continued from where it
    ends, and (a rewind) from where another prompt parts from it: the logits equal those of a
    fresh executor prefilling the same tokens in the scheduler's chunks."""
    f = files[qtype]
    turn1, gen = _prompt(0, 300), _prompt(1, n_gen)
    fed = turn1 + gen[:-1]  # the last sampled token is never fed
    kept = _executor(kind, f)
    steps = [(0, turn1[i : i + budget], i) for i in range(0, len(turn1), budget)]
    steps += [(0, [t], len(turn1) + k) for k, t in enumerate(gen[:-1])]
    _logits(kept, steps)
    turn2 = turn1 + gen + _prompt(2, 20)
    got = _logits(kept, [(0, turn2[len(fed) :], len(fed))])
    fresh = _executor(kind, f)
    want = _logits(fresh, [(1, turn2[i : i + budget], i) for i in range(0, len(turn2), budget)])
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    parted = turn1[:250] + _prompt(3, 30)  # rewinds the kept sequence to 250
    got = _logits(kept, [(0, parted[250:], 250)])
    want = _logits(fresh, [(2, parted[i : i + budget], i) for i in range(0, len(parted), budget)])
    assert np.array_equal(got, want), float(np.abs(got - want).max())


@pytest.mark.parametrize(("kind", "qtype"), CASES)
def test_the_next_turn_over_the_cache_writes_the_fresh_turns_tokens(files, kind, qtype):
    """The scheduler over a real executor: a 3-turn chat with the cache gives each turn the
    greedy tokens a scheduler without one gives it, and reports the kept tokens as cached."""
    f = files[qtype]
    cached = Scheduler(_executor(kind, f), prefill_budget=BUDGET, prefix_cache=PrefixCache())
    fresh = Scheduler(_executor(kind, f), prefill_budget=BUDGET)
    chat = _prompt(0, 300)
    for turn in range(3):
        got, reused = _generate(cached, chat, 16)
        want, _ = _generate(fresh, chat, 16)
        assert got == want, f"turn {turn}"
        # held: the previous turn's prompt and its tokens but the last (never fed)
        assert reused == (len(chat) - 8 - 1 if turn else 0)
        chat = chat + got + _prompt(10 + turn, 8)


def test_eviction_over_two_slots_keeps_every_answer_right(files):
    """Three chats taking turns over a LeanExecutor of two slots (BF16: bit-exact continuation):
    every turn's tokens equal a fresh scheduler's, whether its sequence was kept or evicted."""
    f = files["BF16"]
    cache = PrefixCache()
    cached = Scheduler(_executor("lean", f, max_batch=2), prefill_budget=BUDGET, prefix_cache=cache)
    fresh = Scheduler(_executor("lean", f), prefill_budget=BUDGET)
    chats = [_prompt(20 + c, 40) for c in range(3)]
    hit = []
    for k, c in enumerate([0, 1, 0, 2, 0, 1]):  # 2 evicts 1 (least recent), then 1 evicts 2
        got, reused = _generate(cached, chats[c], 6)
        assert got == _generate(fresh, chats[c], 6)[0], (k, c)
        hit.append(reused > 0)
        chats[c] += got + _prompt(30 + k, 5)
    assert hit == [False, False, True, False, True, False]
    assert cache.evictions == 2 and len(cache) == 2
