"""The pipeline head and stage loop over in-process links (stages in threads): the same math as the
single-node reference, before any socket is involved."""

import threading

import pytest
import torch
from pp_support import (
    executor_greedy,
    prompts,
    reference_greedy,
    reference_model,
    stage_model,
    tiny_config,
)

from tandem.engine.executor import Step, StepSequence
from tandem.engine.pp.frames import LocalStageTransport
from tandem.engine.pp.generate import generate_pipelined
from tandem.engine.pp.head import (
    PipelineExecutor,
    PipelineFailedError,
    split_microbatches,
)
from tandem.engine.pp.stage import StageLinks, StageOrderError, StageRunner, serve_stage
from tandem.engine.sampling_params import SamplingParams


def _serve_quietly(*args, **kw):
    try:
        serve_stage(*args, **kw)
    except Exception:  # the error frame has gone to the head, which is what the tests check
        pass


def build(ref, ranges, microbatches=None, timeout=30.0, stage_max_seq_len=64, max_batch=4):
    """Head (stage 0) here, stages 1.. in threads, linked in a ring by local transports."""
    n = len(ranges)
    links = [LocalStageTransport.pair() for _ in range(n)]  # link k: stage k -> stage k+1 (mod n)
    threads = []
    for k in range(1, n):
        runner = StageRunner(
            stage_model(ref, ranges[k]), max_batch=4, max_seq_len=stage_max_seq_len
        )
        sl = StageLinks(upstream=links[k - 1][1], downstream=[links[k][0]], to_head=k == n - 1)
        t = threading.Thread(
            target=_serve_quietly, args=(runner, sl), kwargs={"name": f"stage {k}"}, daemon=True
        )
        t.start()
        threads.append(t)
    head = stage_model(ref, ranges[0], with_embed=True, with_head=True)
    ex = PipelineExecutor(
        head,
        StageRunner(head, max_batch, 64),
        to_next=[links[0][0]],
        from_last=links[n - 1][1],
        num_stages=n,
        max_batch=max_batch,
        max_seq_len=64,
        timeout=timeout,
        microbatches=microbatches,
    )
    return ex, threads


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
@pytest.mark.parametrize("batch", [1, 3])
def test_threaded_pipeline_matches_single_node(ranges, batch):
    ref = reference_model(tiny_config())
    ps = prompts(batch, 97)
    ref_first, ref_ids = reference_greedy(ref, ps, 12)
    ex, threads = build(ref, ranges)
    try:
        first, ids = executor_greedy(ex, ps, 12)
    finally:
        ex.close()
    torch.testing.assert_close(first, ref_first, atol=1e-4, rtol=0)
    assert ids == ref_ids
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def test_microbatches_are_contiguous_and_balanced():
    seqs = [StepSequence(i, (1,), 0) for i in range(5)]
    groups = split_microbatches(seqs, 3)
    assert [[s.seq_id for s in g] for g in groups] == [[0, 1], [2, 3], [4]]
    assert len(split_microbatches(seqs[:1], 4)) == 1


def test_a_stage_that_fails_is_reported_at_the_head_and_poisons_the_executor():
    ref = reference_model(tiny_config())
    ex, threads = build(ref, [(0, 2), (2, 4)], stage_max_seq_len=8)
    with pytest.raises(PipelineFailedError, match="stage 1: SequenceTooLongError"):
        ex.run(Step((StepSequence(0, tuple(range(10)), 0),)))
    with pytest.raises(PipelineFailedError, match="failed earlier"):
        ex.run(Step((StepSequence(1, (1,), 0),)))
    ex.close()
    threads[0].join(5)
    assert not threads[0].is_alive()


def test_microbatched_step_equals_one_batch():
    ref = reference_model(tiny_config())
    ps = prompts(3, 97)
    ex1, _ = build(ref, [(0, 2), (2, 4)], microbatches=1)
    ex3, _ = build(ref, [(0, 2), (2, 4)], microbatches=3)
    try:
        a = executor_greedy(ex1, ps, 6)
        b = executor_greedy(ex3, ps, 6)
    finally:
        ex1.close()
        ex3.close()
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=0)
    assert a[1] == b[1]


def test_all_micro_batches_enter_the_pipe_before_the_head_waits_for_the_first():
    """Pipelined sends: the head embeds and sends micro-batch k+1 while the stages run micro-batch
    k, and only then waits; every stage sees one frame per micro-batch per step."""
    ref = reference_model(tiny_config())
    ex, _ = build(ref, [(0, 1), (1, 3), (3, 4)], microbatches=3)
    events = []
    send, recv = ex.to_next[0].send, ex.from_last.recv
    ex.to_next[0].send = lambda f: (events.append("send"), send(f))[1]
    ex.from_last.recv = lambda t: (events.append("recv"), recv(t))[1]
    try:
        executor_greedy(ex, prompts(3, 97), 2)
    finally:
        ex.close()
    # prefill and one decode step, three micro-batches each, then the release
    assert events[:12] == ["send"] * 3 + ["recv"] * 3 + ["send"] * 3 + ["recv"] * 3


def test_finishing_a_sequence_frees_its_cache_on_every_stage():
    """Two cache slots per stage, six sequences two at a time: only possible if each release
    reaches every stage (a stage that kept them would run out of slots)."""
    ref = reference_model(tiny_config())
    ex, threads = build(ref, [(0, 1), (1, 3), (3, 4)], max_batch=2)
    try:
        for r in range(3):
            _, ids = executor_greedy(ex, prompts(2, 97, seed=r), 3, base_id=10 * r)
            assert ids == reference_greedy(ref, prompts(2, 97, seed=r), 3)[1]
        assert ex.stage0.live_sequences == 0
    finally:
        ex.close()


def test_a_step_out_of_order_with_a_stage_cache_fails_closed():
    ref = reference_model(tiny_config())
    runner = StageRunner(stage_model(ref, (1, 3)), max_batch=2, max_seq_len=16)
    h = torch.zeros(1, 2, 32)
    runner.forward((7,), (0,), (2,), h)
    with pytest.raises(StageOrderError, match="sequence 7 starts at 5 but this stage holds 2"):
        runner.forward((7,), (5,), (1,), h[:, :1])


def test_pipelined_generation_keeps_a_group_per_stage_in_flight_and_matches_the_reference():
    """Cross-step pipelining: with three groups on three stages, three steps are in flight at once,
    and every sequence's greedy ids equal the single-node reference."""
    ref = reference_model(tiny_config())
    ps = prompts(3, 97)
    _, want = reference_greedy(ref, ps, 10)
    ex, _ = build(ref, [(0, 1), (1, 3), (3, 4)])
    depth, most = 0, 0
    submit, collect = ex.submit, ex.collect

    def counting_submit(step):
        nonlocal depth, most
        depth += 1
        most = max(most, depth)
        return submit(step)

    def counting_collect():
        nonlocal depth
        depth -= 1
        return collect()

    ex.submit, ex.collect = counting_submit, counting_collect
    try:
        res = generate_pipelined(ex, ps, SamplingParams(max_tokens=10, temperature=0.0), groups=3)
    finally:
        ex.close()
    assert [r.token_ids for r in res] == want
    assert most == 3
    assert ex.stage0.live_sequences == 0
