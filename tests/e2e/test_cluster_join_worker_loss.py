"""A joined cluster survives losing its worker. Two `cluster join` nodes on loopback (a TP=2 group
from one token); the worker's process is SIGKILLed in the middle of 4 streaming greedy requests.
The head stays up with `/health` 503 "re-forming", the worker's `cluster join --rejoin` starts a
new worker process that claims the head's next epoch from the status board, the head keeps its
loaded shard and re-forms only the links, replays the sequences in flight, and every stream ends
with the text of an uninterrupted run. The same when the worker hangs (SIGSTOP): the head gives it
up at its op timeout, and the worker's node ends it once the board shows the next epoch. A pair
whose worker never returns shrinks to its head. Real processes on loopback; no timing is
asserted."""

import json
import signal

import pytest
from serve_support import TANDEM, kill_tree, make_model, metric, output, spawn, wait_healthy
from test_cluster_cli import _cli

from tandem.bench.fault_drill import health, run_drill, worker_pids
from tandem.cluster.launcher import free_port_block, free_ports

PROMPTS = ["Once upon a time", "The cat", "In a galaxy far away", "Hello"]
MAX_TOKENS = 40
COUNTERS = (
    "tandem_group_failures_total",
    "tandem_group_reforms_total",
    "tandem_replayed_sequences_total",
)


OP_TIMEOUT_S = 5  # the head's bound on a step: a SIGSTOPped worker counts as hung after it


def _token() -> str:
    base_port = free_port_block(4)
    return _cli(
        "cluster",
        "init",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--base-port",
        str(base_port),
        "--no-qr",
    ).stdout.split()[-1]


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    """(head node, worker node, base URL, token, the quiet run's texts): a TP=2 pair from one
    token, the worker joined with --rejoin, the head with a short op timeout."""
    tmp = tmp_path_factory.mktemp("joined")
    model = make_model(tmp / "model")
    token = _token()
    (http_port,) = free_ports(1)
    base = f"http://127.0.0.1:{http_port}"

    def join(rank: int, *extra: str):
        argv = [*TANDEM, "cluster", "join", token, "--rank", str(rank), "--model", str(model)]
        argv += ["--config-dir", str(tmp / f"n{rank}"), "--port", str(http_port), *extra]
        return spawn(argv)

    node = join(1, "--rejoin")
    head = join(0, "--reform-timeout", "120", "--op-timeout", str(OP_TIMEOUT_S))
    try:
        wait_healthy(head, base)
        quiet = run_drill(base, node.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=None)
        assert [s.error for s in quiet.streams] == [None] * 4
        yield head, node, base, token, [s.text for s in quiet.streams]
    finally:
        kill_tree(head)
        kill_tree(node)


def _drill_rejoins(joined, sig) -> None:
    head, node, base, token, quiet = joined
    before = worker_pids(node.pid)
    counts = [metric(base, name) for name in COUNTERS]
    epoch = json.loads(_cli("cluster", "status", token, "--json").stdout)["ranks"][0].get(
        "epoch", 0
    )

    drill = run_drill(base, node.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=sig, timeout_s=240)

    assert drill.victim_pid in before and drill.in_flight_at_fault == 4
    assert [s.error for s in drill.streams] == [None] * 4, (
        drill.health[-3:],
        output(head)[-2000:],
        output(node)[-3000:],
    )
    assert [s.text for s in drill.streams] == quiet
    assert all(s.finish_reason == "length" for s in drill.streams)
    # /health: 503 saying why while the group re-formed, 200 once it had
    assert drill.detect_s is not None and drill.whole_s is not None
    reasons = {detail for _, code, detail in drill.health if code == 503}
    assert reasons and all(r.startswith("re-forming") for r in reasons), reasons
    assert health(base)[0] == 200 and head.poll() is None and node.poll() is None
    after = worker_pids(node.pid)
    assert len(after) == 1 and drill.victim_pid not in after
    grown = [metric(base, name) - n for name, n in zip(COUNTERS, counts)]
    assert grown == [1, 1, 4]  # one failure, one re-form, 4 sequences replayed
    # only the returning worker loaded: the head kept its shard, under the next epoch
    assert "the head kept its loaded shard" in output(head)
    snap = json.loads(_cli("cluster", "status", token, "--json").stdout)
    assert snap["ranks"][0]["epoch"] == epoch + 1
    print(
        f"detect {drill.detect_s:.2f} s, whole again {drill.whole_s:.2f} s, "
        f"resume {drill.resume_s:.2f} s after the signal"
    )


# ~70 s on 2 shared cores with the fixture: a head node and a worker node start and load the model,
# then a third process (the returning worker) starts, loads its shard and joins while 4 streams wait
@pytest.mark.slow
def test_a_joined_worker_killed_mid_stream_rejoins_the_next_epoch_and_every_stream_equals_a_quiet_run(
    joined,
):
    _drill_rejoins(joined, signal.SIGKILL)


# ~35 s more: the hung worker is seen at the head's op timeout; its `cluster join --rejoin` sees
# the head form the next epoch without it, ends it and joins that epoch with a new worker
@pytest.mark.slow
def test_a_joined_worker_hung_mid_stream_is_replaced_by_its_node_and_every_stream_equals_a_quiet_run(
    joined,
):
    _drill_rejoins(joined, signal.SIGSTOP)


# ~40 s on 2 shared cores: a head node and a worker node start and load the model; the head then
# loads the whole model alone
@pytest.mark.slow
def test_a_joined_worker_that_never_returns_leaves_the_head_serving_alone_with_equal_texts(
    tmp_path,
):
    model = make_model(tmp_path / "model")
    token = _token()
    (http_port,) = free_ports(1)
    base = f"http://127.0.0.1:{http_port}"

    def join(rank: int, *extra: str):
        argv = [*TANDEM, "cluster", "join", token, "--rank", str(rank), "--model", str(model)]
        argv += ["--config-dir", str(tmp_path / f"n{rank}"), "--port", str(http_port), *extra]
        return spawn(argv)

    node = join(1)
    head = join(0, "--reform-timeout", "120", "--shrink-after", "3")
    try:
        wait_healthy(head, base)
        quiet = run_drill(base, node.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=None)
        assert [s.error for s in quiet.streams] == [None] * 4
        # the worker's node goes whole (its join and its worker): nothing comes back
        drill = run_drill(
            base, node.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=signal.SIGKILL, timeout_s=240
        )
        kill_tree(node)
        assert drill.in_flight_at_fault == 4
        assert [s.error for s in drill.streams] == [None] * 4, (drill.health[-3:], output(head))
        assert [s.text for s in drill.streams] == [s.text for s in quiet.streams]
        reasons = {detail for _, code, detail in drill.health if code == 503}
        assert reasons and all(r.startswith("re-forming") for r in reasons), reasons
        assert health(base)[0] == 200 and head.poll() is None
        assert metric(base, "tandem_group_shrinks_total") == 1
        assert metric(base, "tandem_replayed_sequences_total") == 4
    finally:
        kill_tree(head)
        kill_tree(node)
