"""Tensor parallelism across real processes on loopback: N-1 `tandem worker` processes + the head,
over the TCP ring, compared with the single-node reference."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from tp_support import (
    SingleNode,
    assert_same_logits,
    greedy,
    launch_concurrently,
    run_rewind_script,
    tiny_config,
    write_random_model,
)

from tandem.engine.executor import Step, StepSequence
from tandem.engine.runner import StepOrderError
from tandem.engine.tp.head import GroupFailedError
from tandem.engine.tp.local import launch_local_tp

PROMPTS = [[5, 17, 33, 2, 8, 100, 7], [40, 41, 300], [9, 9, 9, 1, 2, 3, 4, 70, 11, 12]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 4 kv heads: TP=3 splits them 2,1,1 (uneven), 2:1 weights split them 3,1
    config = tiny_config(
        "Qwen3ForCausalLM", vocab_size=512, num_attention_heads=8, num_key_value_heads=4
    )
    return write_random_model(tmp_path_factory.mktemp("tp") / "m", config)


@pytest.fixture(scope="module")
def expected(model_dir):
    ref = SingleNode(model_dir)
    return {b: greedy(ref, PROMPTS[:b], 32) for b in (1, 3)}


LAYOUTS = [(2, None), (3, None), (2, (2.0, 1.0))]


def _launched(specs):
    """`launch_concurrently(specs)` for a module fixture: every group closed at the end."""
    started = launch_concurrently(specs, max_batch=4, max_seq_len=128, threads=1)
    try:
        yield started
    finally:
        for ex in started.values():
            ex.close()


@pytest.fixture(scope="module")
def groups(model_dir):
    """The three layouts' groups, their worker processes started at once."""
    yield from _launched({lay: (model_dir, lay[0], {"weights": lay[1]}) for lay in LAYOUTS})


@pytest.mark.parametrize("tp,weights", LAYOUTS)
def test_tp_matches_single_node_across_processes(groups, expected, tp, weights):
    ex = groups[(tp, weights)]
    with pytest.raises(StepOrderError):  # refused on the head, before any worker sees it
        ex.run(Step((StepSequence(1, (3,), 5),)))
    for batch in (1, 3):
        start = ex.comm_stats.copy()
        ids, first = greedy(ex, PROMPTS[:batch], 32)
        want_ids, want_first = expected[batch]
        assert (first - want_first).abs().max().item() < 1e-4
        assert ids == want_ids
        # argmax on the ranks: one (max, index) pair per rank reaches the head, not its logits
        mid = ex.comm_stats.copy()
        ids, _ = greedy(ex, PROMPTS[:batch], 32, on_ranks=True)
        assert ids == want_ids
        with_logits = mid.bytes_moved - start.bytes_moved
        argmax_only = ex.comm_stats.bytes_moved - mid.bytes_moved
        # every rank but 0 ships >= a quarter of the vocabulary per row and step with the logits
        assert with_logits - argmax_only >= 32 * batch * 4 * (ex.vocab_size // 4)
    assert ex.comm_stats.collectives > 0


def test_every_rank_reports_its_probe_and_every_ring_link_the_groups_latency(groups):
    """Measured as each group formed (`engine/tp/probe.py`) and shown by `describe` (the page)."""
    for ex in groups.values():
        d = ex.describe()
        for rank in d["ranks"]:
            assert rank["probe"]["gemv_gb_s"] > 0 and rank["probe"]["free_gb"] > 0
        for link in d["links"]:
            assert link["rtt_ms"] > 0 and link["goodput_mbit_s"] > 0


def test_each_ranks_compute_in_service_and_its_balancing_weights_are_shown(groups, expected):
    """Between steps the head gathers every rank's compute clock (`engine/tp/balance.py`), and
    the group steps on in lockstep after it."""
    for (tp, _), ex in groups.items():
        greedy(ex, PROMPTS[:1], 4)
        bal = ex.describe()["balance"]
        assert bal["steps"] >= 4 and len(bal["compute_ms_per_step"]) == tp
        assert all(c > 0 for c in bal["compute_ms_per_step"])
        assert bal["weights"] == pytest.approx(list(ex.layout.weights), abs=1e-3)
        assert min(bal["balanced_weights"]) == 1.0 and len(bal["balanced_weights"]) == tp
        ids, _ = greedy(ex, PROMPTS[:1], 32)
        assert ids == expected[1][0]


def test_a_tp_group_rewinds_a_sequence_as_single_node_does(groups, model_dir):
    """A step whose start_pos is behind the cached length re-prefills from there on every rank
    (each rank's `SequenceCache` applies the same rule), mixed in one step with another
    sequence's decode token: every step's logits equal single node's."""
    want = run_rewind_script(SingleNode(model_dir))
    for ex in groups.values():
        assert_same_logits(run_rewind_script(ex), want)


ATTN_LAYOUTS = [(3, 2), (2, 1)]  # (ranks, attention ranks): the MLP on every rank


@pytest.fixture(scope="module")
def attn_groups(model_dir):
    yield from _launched({k: (model_dir, k[0], {"attn_ranks": k[1]}) for k in ATTN_LAYOUTS})


@pytest.mark.parametrize("tp,attn", ATTN_LAYOUTS)
def test_attention_on_fewer_ranks_than_the_mlp_matches_single_node_across_processes(
    attn_groups, expected, tp, attn
):
    ex = attn_groups[(tp, attn)]
    for batch in (1, 3):
        ids, first = greedy(ex, PROMPTS[:batch], 32)
        want_ids, want_first = expected[batch]
        assert (first - want_first).abs().max().item() < 1e-4
        assert ids == want_ids
    shards = [f.shard for f in ex.facts]
    assert [s["kv_heads"][1] > s["kv_heads"][0] for s in shards] == [r < attn for r in range(tp)]


def _worker_pids(ex):
    return [psutil.Process(p.pid) for p in ex.local_workers.group.procs]


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_lost_worker_fails_the_head_within_the_op_timeout(model_dir, how):
    op_timeout = 10.0  # long enough for a loaded CI machine to start the group
    ex = launch_local_tp(
        model_dir, 2, max_batch=2, max_seq_len=128, op_timeout=op_timeout, threads=1
    )
    workers = _worker_pids(ex)
    try:
        greedy(ex, PROMPTS[:1], 3)  # the group works
        (w,) = workers
        os.kill(w.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(GroupFailedError, match="tensor-parallel group failed") as err:
            greedy(ex, PROMPTS[:1], 3)
        elapsed = time.monotonic() - t0
        assert elapsed < op_timeout + 3.0
        if how == "kill":
            assert "rank1 exited" in str(err.value)
    finally:
        ex.close()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


def test_workers_exit_on_their_own_when_the_heads_connection_closes(model_dir):
    ex = launch_local_tp(model_dir, 3, max_batch=2, max_seq_len=128, threads=1)
    try:
        greedy(ex, PROMPTS[:1], 2)
        procs = ex.local_workers.group.procs
        ex.comm.close()  # no STOP frame: the sockets just close, as when a head machine dies
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        assert all(p.poll() is not None for p in procs)
    finally:
        ex.close()


def test_killing_the_head_process_takes_its_workers_down(model_dir, tmp_path):
    script = tmp_path / "head.py"
    script.write_text(
        "import sys, time\n"
        "from tandem.engine.tp.local import launch_local_tp\n"
        f"ex = launch_local_tp({str(model_dir)!r}, 2, max_batch=1, max_seq_len=64, threads=1)\n"
        "print(' '.join(str(p.pid) for p in ex.local_workers.group.procs), flush=True)\n"
        "time.sleep(600)\n"
    )
    head = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in head.stdout.readline().split()]
        assert pids
        head.kill()  # SIGKILL: no finally runs in the head
        head.wait(10)
        deadline = time.monotonic() + 15.0
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [
                p
                for p in pids
                if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            ]
            time.sleep(0.1)
        assert not alive
    finally:
        if head.poll() is None:
            head.kill()
