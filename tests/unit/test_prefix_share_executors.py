"""Concurrent requests sharing a system prompt through the scheduler over real executors on a
tiny GGUF file (tiny-qwen3's shape): the first prefills the shared part, the others copy it
(`Executor.copy_prefix`) as soon as it is written, and every request writes exactly the greedy
tokens it writes alone on a fresh executor without a cache. Bit equality rests on batch
invariance (tests/unit/test_batch_invariance.py): the copied keys and values were written by
another sequence's prefill chunks, a cold run writes them in its own."""

import dataclasses

import numpy as np
import pytest

from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, Scheduler
from tandem.kernels import native
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    cfg = dataclasses.replace(get_preset("tiny-qwen3").config, max_position_embeddings=1024)
    out = tmp_path_factory.mktemp("share")
    made = {}
    for qtype in ("BF16", "Q8_0"):
        _, (f,) = write_preset_gguf(out / f"tiny-{qtype}.gguf", "tiny-qwen3", qtype, config=cfg)
        made[qtype] = f
    return made


def _executor(kind: str, f, max_batch: int = 4):
    if kind == "lean":
        from tandem.engine.lean import LeanExecutor

        return LeanExecutor.from_file(f, max_batch=max_batch, max_seq_len=512, threads=2)
    from tandem.engine.local import LocalExecutor

    return LocalExecutor.from_dir(f, max_batch=max_batch, max_seq_len=512)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _submit(sched: Scheduler, prompt: list[int], n: int) -> tuple[list[int], Request]:
    tokens: list[int] = []
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return tokens, sched.submit(Request(list(prompt), params, tokens.append, lambda r, e: None))


@pytest.mark.parametrize(("kind", "qtype"), [("lean", "Q8_0"), ("lean", "BF16"), ("local", "Q8_0")])
def test_concurrent_requests_copy_the_shared_prompt_and_write_their_cold_tokens(files, kind, qtype):
    f = files[qtype]
    system = _prompt(0, 150)
    prompts = [system + _prompt(1 + c, 5 + 7 * c) for c in range(4)]
    cache = PrefixCache()
    sched = Scheduler(_executor(kind, f), prefill_budget=64, prefix_cache=cache)
    runs = [_submit(sched, p, 8) for p in prompts]
    while sched.step():
        pass
    assert [req.cached_tokens for _, req in runs] == [0] + [len(system)] * 3
    assert cache.stats()["copies"] == 3
    cold = Scheduler(_executor(kind, f), prefill_budget=64)
    for p, (got, _) in zip(prompts, runs):
        want, _ = _submit(cold, p, 8)
        while cold.step():
            pass
        assert got == want
