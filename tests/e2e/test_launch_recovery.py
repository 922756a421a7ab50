"""`tandem launch --tp 2` survives a SIGKILLed (then a SIGSTOPped) worker in the middle of 4
streaming greedy requests: the head starts a new worker, re-forms the group under a new epoch,
replays the sequences in flight, and every stream completes with the text of an uninterrupted run;
so does `tandem launch --pp 2` with its stage process SIGKILLed, then SIGSTOPped, then its links
blackholed, and
`tandem launch --tp 2 --pp 2` with one of its stage processes SIGSTOPped, and `tandem launch
--tp 2` whose worker's links are blackholed (a relay in the test keeps every connection open and
forwards nothing, as a pulled cable or a firewall DROP rule would).
The op timeout is 60 s, so the hung (SIGSTOPped) worker or stage, or the silent link, is seen by
its heartbeat (`--heartbeat-timeout 2`): /health turns 503 naming it within 5 s, far below the op
timeout.
A blackholed link of the pipeline's stage process, and of the grid's stage 1 TP rank 1, the same.
Every drill also bounds each stream's silence across the fault by the heartbeat's detection bound
plus the re-form it measured plus a replay's prefill and two steps of the quiet run
(`fault_drill.pause_bound`): the streams waited for the loss to be seen and the group to re-form,
not longer.
Real processes on loopback; timings are printed by scripts/bench/recovery.py; only those bounds
are asserted here."""

import signal
import time

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

PROMPTS = ["Once upon a time", "The cat", "In a galaxy far away", "Hello"]
MAX_TOKENS = 48
OP_TIMEOUT_S = 60  # a hung worker must be seen by its heartbeat, not at this bound
HEARTBEAT_S = 2  # a worker silent this long is lost (`--heartbeat-timeout`)
SEEN_WITHIN_S = 5  # /health 503 after a SIGSTOP: heartbeat timeout + a beat + the 0.05 s polls


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("recovery") / "model")


def _launch(model, layout, env=None):
    args = ["launch", "--model", str(model), *layout, "--no-demo", "--max-batch", "4"]
    timeouts = ["--op-timeout", str(OP_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_S)]
    with running([*args, "--reform-timeout", "120", *timeouts], env=env) as up:
        yield up


@pytest.fixture(scope="module")
def launched(model):
    yield from _launch(model, ["--tp", "2"])


@pytest.fixture(scope="module")
def relayed_pp(model):
    """`tandem launch --pp 2` whose stage process's (rank 1's) links all run through a relay
    (forwarding until a test blackholes them); yields (relay, (proc, base))."""
    with relay_for_links("1") as (relay, env):
        for up in _launch(model, ["--tp", "1", "--pp", "2"], env):
            yield relay, up


@pytest.fixture(scope="module")
def launched_pp(relayed_pp):
    return relayed_pp[1]


def _server_pid(proc):
    """`tandem launch` runs the head as `tandem serve`, whose children are the workers."""
    import psutil

    for c in psutil.Process(proc.pid).children():
        if "serve" in c.cmdline():
            return c.pid
    raise AssertionError("no `tandem serve` below `tandem launch`")


def _quiet(launched):
    """The uninterrupted run (its texts, and its step and prefill times under this load)."""
    proc, base = launched
    res = run_drill(base, _server_pid(proc), PROMPTS, max_tokens=MAX_TOKENS, sig=None)
    assert [s.error for s in res.streams] == [None] * 4
    assert all(s.finish_reason == "length" for s in res.streams)
    return res


def _texts(drill):
    return [s.text for s in drill.streams]


@pytest.fixture(scope="module")
def quiet(launched):
    return _quiet(launched)


@pytest.fixture(scope="module")
def relayed_grid(model):
    """`tandem launch --tp 2 --pp 2` whose stage 1 TP rank 1's (global rank 3's) pipeline links
    (from stage 0, its beat to the head) run through a relay; its ring with stage 1's rank 0 keeps
    shared memory. Yields (relay, (proc, base))."""
    with relay_for_links("3", tcp_ring=False) as (relay, env):
        for up in _launch(model, ["--tp", "2", "--pp", "2"], env):
            yield relay, up


@pytest.fixture(scope="module")
def launched_grid(relayed_grid):
    return relayed_grid[1]


@pytest.fixture(scope="module")
def quiet_pp(launched_pp):
    return _quiet(launched_pp)


COUNTERS = (
    "tandem_group_failures_total",
    "tandem_group_reforms_total",
    "tandem_replayed_sequences_total",
)


@pytest.fixture(scope="module")
def relayed(model):
    """`tandem launch --tp 2` whose worker's (rank 1's) links all run through a relay; yields
    (relay, (proc, base))."""
    with relay_for_links("1") as (relay, env):
        for up in _launch(model, ["--tp", "2"], env):
            yield relay, up


def _drill_replays_every_stream(launched, quiet, sig, workers: int = 1, fault=None):
    proc, base = launched
    server = _server_pid(proc)
    before = worker_pids(server)
    counts = [metric(base, name) for name in COUNTERS]

    drill = run_drill(
        base, server, PROMPTS, max_tokens=MAX_TOKENS, sig=sig, timeout_s=240, fault=fault
    )

    assert drill.victim_pid in before and drill.in_flight_at_fault == 4
    assert [s.error for s in drill.streams] == [None] * 4, drill.health[-3:]
    assert _texts(drill) == _texts(quiet)
    assert all(s.finish_reason == "length" for s in drill.streams)
    # /health: 503 saying why while the group re-formed, 200 once it had
    assert drill.detect_s is not None and drill.whole_s is not None
    # the streams paused for the detection and the re-form (and the replay's prefill), no longer
    assert_paused_within_bound(drill, quiet, HEARTBEAT_S, OP_TIMEOUT_S)
    reasons = {detail for _, code, detail in drill.health if code == 503}
    assert all(r.startswith("re-forming") for r in reasons), reasons
    assert health(base)[0] == 200 and proc.poll() is None
    # the supervisor replaced the killed worker; the old one is gone
    after = worker_pids(server)
    assert len(after) == workers and drill.victim_pid not in after
    grown = [metric(base, name) - n for name, n in zip(COUNTERS, counts)]
    assert grown == [1, 1, 4]  # one failure, one re-form, 4 sequences replayed
    return drill, reasons


# ~65 s on 2 shared cores: `tandem launch` brings up a head and a worker, then a third process
# (the replacement worker) starts, loads its shard and joins while 4 streams wait
@pytest.mark.slow
def test_sigkilled_tp_worker_mid_stream_is_replaced_and_every_stream_equals_a_quiet_run(
    launched, quiet
):
    _drill_replays_every_stream(launched, quiet, signal.SIGKILL)


# ~30 s more: the hung worker is seen by its heartbeat, then replaced as above
@pytest.mark.slow
def test_sigstopped_tp_worker_mid_stream_is_seen_by_its_heartbeat_and_replaced(launched, quiet):
    drill, reasons = _drill_replays_every_stream(launched, quiet, signal.SIGSTOP)
    assert drill.detect_s <= SEEN_WITHIN_S < OP_TIMEOUT_S, (drill.detect_s, reasons)
    assert any("rank 1 is lost" in r and "heartbeat" in r for r in reasons), reasons


# ~50 s on 2 shared cores: its own `tandem launch` (ring on TCP through the relay), a quiet run,
# the cut seen by the heartbeat, a new worker over a new (forwarded) connection
@pytest.mark.slow
def test_a_blackholed_tp_worker_link_mid_stream_is_seen_by_its_heartbeat_and_replaced(relayed):
    relay, launched = relayed
    assert len(relay.destinations) >= 4, relay.destinations  # ring links and heartbeats
    drill, reasons = _blackhole_drill(relay, launched, links=4, workers=1)
    print(f"launch tp2 blackholed: 503 at {drill.detect_s:.2f} s, 200 at {drill.whole_s:.2f} s")
    assert lost_by_a_heartbeat(reasons, 1, ""), reasons


# ~70 s on 2 shared cores: its own `tandem launch` (a head and a stage process), then a new stage
@pytest.mark.slow
def test_a_sigkilled_pipeline_stage_mid_stream_is_replaced_and_every_stream_equals_a_quiet_run(
    launched_pp, quiet_pp
):
    _drill_replays_every_stream(launched_pp, quiet_pp, signal.SIGKILL)


# ~30 s more: the hung stage is seen by its heartbeat to the head, then replaced as above
@pytest.mark.slow
def test_a_sigstopped_pipeline_stage_mid_stream_is_seen_by_its_heartbeat_and_replaced(
    launched_pp, quiet_pp
):
    drill, reasons = _drill_replays_every_stream(launched_pp, quiet_pp, signal.SIGSTOP)
    assert drill.detect_s <= SEEN_WITHIN_S < OP_TIMEOUT_S, (drill.detect_s, reasons)
    assert any("rank 1 is lost" in r and "(stage 1)" in r for r in reasons), reasons


# ~60 s on 2 shared cores: a head and three stage processes, then three new ones
@pytest.mark.slow
def test_a_sigstopped_grid_rank_mid_stream_is_seen_by_its_heartbeat_and_replaced(launched_grid):
    """`--tp 2 --pp 2`: one of the three stage processes (stage 0's TP rank 1, or a rank of
    stage 1) is SIGSTOPped; the head sees it by its heartbeat and the whole grid re-forms."""
    quiet = _quiet(launched_grid)
    drill, reasons = _drill_replays_every_stream(launched_grid, quiet, signal.SIGSTOP, workers=3)
    assert drill.detect_s <= SEEN_WITHIN_S < OP_TIMEOUT_S, (drill.detect_s, reasons)
    # the rank named by its heartbeat, with its place in the grid right after the loss
    # ("rank N is lost (stage k, TP rank r)"), early enough for /health's shortened detail
    assert any("is lost" in r and "heartbeat" in r and "TP rank" in r for r in reasons), reasons


def _blackhole_drill(relay, launched, links: int, workers: int):
    cut: list[int] = []
    drill, reasons = _drill_replays_every_stream(
        launched, _quiet(launched), None, workers=workers,
        fault=lambda _pid: cut.append(relay.blackhole()),
    )  # fmt: skip
    assert cut and cut[0] >= links, (cut, relay.destinations)
    assert drill.detect_s <= SEEN_WITHIN_S < OP_TIMEOUT_S, (drill.detect_s, reasons)
    return drill, reasons


# ~25 s past the shared `launch --pp 2`: a quiet run, the cut seen by a heartbeat, a new stage
# over new (forwarded) connections
@pytest.mark.slow
def test_a_blackholed_pipeline_stage_link_mid_stream_is_seen_by_its_heartbeat_and_replaced(
    relayed_pp,
):
    relay, launched = relayed_pp
    # the head's link to the stage, the stage's link back, the stage's beat to the head
    drill, reasons = _blackhole_drill(relay, launched, links=3, workers=1)
    print(f"launch pp2 blackholed: 503 at {drill.detect_s:.2f} s, 200 at {drill.whole_s:.2f} s")
    assert lost_by_a_heartbeat(reasons, 1, "(stage 1)"), reasons


# ~30 s past the shared grid: stage 1's TP rank 1 cut off from stage 0 and the head, the grid
# re-formed over new (forwarded) connections
@pytest.mark.slow
def test_a_blackholed_grid_rank_link_mid_stream_is_seen_by_its_heartbeat_and_replaced(
    relayed_grid,
):
    relay, launched = relayed_grid
    # stage 0's link to rank 3 and rank 3's beat to the head
    drill, reasons = _blackhole_drill(relay, launched, links=2, workers=3)
    print(f"launch grid blackholed: 503 at {drill.detect_s:.2f} s, 200 at {drill.whole_s:.2f} s")
    assert lost_by_a_heartbeat(
        reasons, 3, "(stage 1, TP", peer="stage 1 (TP rank 0): PeerClosedError: rank 1 ("
    ), reasons


# ~15 s past the shared launch: the attack is held through one HTTP request-read deadline (10 s)
def test_slow_drip_on_every_port_and_a_flood_leave_the_generation_and_the_memory_unchanged(
    launched, quiet
):
    """A few clients dripping a byte a second on every port the cluster listens on (HTTP, the
    ranks' ring listeners) and a flood of a few hundred idle connections, while 4 greedy streams
    run: the streams equal the quiet run's, the connections are cut at their deadlines, the
    pending ones stay capped, and no process grows by 10 MB."""
    import psutil
    from hostile_support import FRAME_DRIP, HTTP_DRIP, Drip, Flood, listening_ports

    from tandem.server.http_limits import MAX_CONNECTIONS, REQUEST_READ_TIMEOUT_S

    proc, base = launched
    server = _server_pid(proc)
    http_port = int(base.rsplit(":", 1)[1])
    tree = [proc.pid, server, *worker_pids(server)]
    ports = listening_ports(tree)
    assert http_port in ports
    rss0 = {pid: psutil.Process(pid).memory_info().rss for pid in tree}

    drips = [
        Drip(port, HTTP_DRIP if port == http_port else FRAME_DRIP) for port in ports for _ in (0, 1)
    ]
    for d in drips:
        d.start()
    floods = {port: Flood(port, 300 if port == http_port else 100, b"TN") for port in ports}
    t_attack = time.monotonic()
    drill = run_drill(base, server, PROMPTS, max_tokens=MAX_TOKENS, sig=None, timeout_s=120)
    assert [s.error for s in drill.streams] == [None] * 4
    assert _texts(drill) == _texts(quiet)
    assert {code for _, code, _ in drill.health} == {200}  # /health answered throughout
    # the HTTP flood is held within its cap, then cut at the request-read deadline, as are drips
    held = floods[http_port].open_count()
    assert held <= MAX_CONNECTIONS
    cut_by = REQUEST_READ_TIMEOUT_S + 5.0
    while time.monotonic() - t_attack < cut_by and floods[http_port].open_count():
        time.sleep(0.2)
    assert floods[http_port].open_count() == 0
    for d in drips:
        d.join(max(0.0, cut_by - (time.monotonic() - t_attack)))
    report = {(d.port, d.cut_after_s) for d in drips}
    print(f"ports {ports}; drips cut after {sorted(report)}; held HTTP {held}")
    print({p: (len(f.socks), f.refused, f.open_count()) for p, f in floods.items()})
    assert all(d.cut_after_s is not None and d.cut_after_s < cut_by for d in drips), report
    for f in floods.values():
        f.stop()
    for d in drips:
        d.stop()
    time.sleep(1.0)
    grown = {pid: psutil.Process(pid).memory_info().rss - rss0[pid] for pid in tree}
    print(f"RSS grown (MB): {[round(g / 2**20, 2) for g in grown.values()]}")
    assert max(grown.values()) < 10 << 20, grown
    assert health(base)[0] == 200 and proc.poll() is None
