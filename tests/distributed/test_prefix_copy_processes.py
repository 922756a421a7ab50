"""`copy_prefix` across real processes on loopback: a TP=2 group (the head and a `tandem worker`,
one COPY control frame, each rank copying its own kv-head shard), a PP=2 pipeline (the head and a
stage process, one COPY stage frame, each stage its layers) and grids (stage 1, or stage 0 beside the head, a
TP=2 group).
A request continued from a copied prefix gives, bit for bit, the logits of the same request run
cold through the same group (equality per layout, as batch invariance holds per layout:
tests/distributed/test_batch_invariance_processes.py), and the source runs on untouched. A copy
the head refuses reaches no rank: the group runs on. Through the scheduler over the PP=2
pipeline (two steps in flight), concurrent requests sharing a system prompt copy it from the
first while its prefill is in flight, and each writes the ids it writes alone."""

from __future__ import annotations

import pytest
from invariance_support import write_tiny_gguf
from prefix_copy_support import check_copy_equals_cold, prompt_of, run

from tandem.engine.pp.launch import StageSpec, launch_pipeline
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Request, Scheduler
from tandem.engine.sequences import PrefixCopyError
from tandem.engine.tp.local import launch_local_tp
from tandem.kernels import native
from tandem.parallel.partition import LayerRange as R

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

MAX_BATCH, MAX_LEN = 8, 96


def launch(layout: str, f):
    common = dict(max_batch=MAX_BATCH, max_seq_len=MAX_LEN, threads=1)
    if layout == "tp2":
        return launch_local_tp(f, 2, **common)
    first = StageSpec(R(0, 1), tp=2 if layout == "tp2-pp2" else 1)
    second = StageSpec(R(1, 2), tp=2 if layout == "pp2-tp2" else 1)
    return launch_pipeline(f, [first, second], timeout=60, **common)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "pp2-tp2", "tp2-pp2"])
def test_a_copied_prefix_continues_as_a_cold_run_on_every_rank(tmp_path, layout):
    f = write_tiny_gguf(tmp_path / "tiny-qwen3-BF16.gguf", "BF16")
    ex = launch(layout, f)
    try:
        check_copy_equals_cold(ex, ex, 41)
        with pytest.raises(PrefixCopyError, match="holds 62"):
            ex.copy_prefix(0, 2, 63)  # the source holds 62 positions
        ex.release([1])
        check_copy_equals_cold(ex, ex, 60, ids=(0, 1, 2, 3))  # the whole source, its slot again
        run(ex, 4, prompt_of(5, 3), 0)  # the group is whole after all of it
    finally:
        ex.close()


def _serve(sched: Scheduler, prompts: list[list[int]]) -> list[tuple[Request, list[int]]]:
    """Submits every prompt at once (greedy, 5 tokens each) and steps until all have finished:
    each request with its ids."""
    out = []
    for p in prompts:
        ids: list[int] = []
        req = Request(list(p), SamplingParams(max_tokens=5, temperature=0), ids.append,
                      lambda reason, err: None)  # fmt: skip
        sched.submit(req)
        out.append((req, ids))
    while sched.step():
        pass
    return out


def test_over_a_pipeline_concurrent_requests_copy_the_shared_prompt_and_write_their_alone_ids(
    tmp_path,
):
    f = write_tiny_gguf(tmp_path / "tiny-qwen3-BF16.gguf", "BF16")
    ex = launch("pp2", f)
    try:
        system = prompt_of(3, 40)
        prompts = [system + prompt_of(10 + i, 3) for i in range(4)]
        alone = [_serve(Scheduler(ex), [p])[0][1] for p in prompts]  # released when done
        cache = PrefixCache(min_tokens=16)
        shared = _serve(Scheduler(ex, prefill_budget=16, prefix_cache=cache), prompts)
        assert [r.cached_tokens for r, _ in shared] == [0] + [len(system)] * 3
        assert cache.stats()["copies"] == 3
        assert [ids for _, ids in shared] == alone
    finally:
        ex.close()
