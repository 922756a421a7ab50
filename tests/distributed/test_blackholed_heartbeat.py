"""A blackholed link (every connection stays open and carries nothing, as behind a pulled cable or
a firewall DROP rule) is seen by the heartbeats, not the op timeout, and the group re-forms and
replays: a served request cut mid-generation finishes with an uninterrupted run's text.

A real serving engine (`build_serving_engine`, as `tandem serve --tp/--pp` runs it, re-form on)
whose links run through a userspace relay (`tcp_proxy.Relay`; the dialing side is
`tandem.transport.relay_seam`, since heartbeat and stage ports are ephemeral). The op timeout is
60 s and the heartbeat timeout 1.5 s, so the heartbeat is what saw the loss. Three cuts:

- tp2-rank1: every link of TP rank 1 (both ring links and both heartbeat connections);
- pp2-stage1: every link of stage 1 (the head's link to it, its link back, its beat to the head);
- pp3-link1-2: only the stage link between stages 1 and 2 (data and its heartbeat), both stages
  still beating the head: the stage that hears its neighbour fall silent reports it to the head
  (`tandem.engine.pp.beats`), which names the link.

The relay forwards the connections made after the cut (the re-formed group's), as over a new cable.
And in a grid (stages of TP 1, 1, 2 through `launch_pipeline`, idle): the link from stage 1 to
the second TP rank of stage 2, which has no other link to stage 1, is watched the same way.
Both ends of a cut go silent at once, so the loss may be named by the rank's own heartbeat: it
exits with PEER_LOST_EXIT, which the head names (a stage's exit code is tested on its own below).
Below too: a stage that exits behind a dark link does not hold the head's step to the op timeout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from tcp_proxy import Relay

from tandem.cluster.exits import PEER_LOST_EXIT
from tandem.engine.executor import Step, StepSequence
from tandem.engine.pp.head import PipelineFailedError
from tandem.engine.pp.launch import launch_pipeline
from tandem.engine.pp.layout import plan_stages
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.make import make_model_dir
from tandem.models.presets import get_preset
from tandem.transport.relay_seam import ENV

OP_TIMEOUT_S = 60.0
HEARTBEAT_S = 1.5
BOUND_S = 2 * HEARTBEAT_S + 2.0  # timeout + a beat interval + a loaded 2-core machine's slack
PROMPT = list(range(1, 40))
NEW = 120

# (tp, pp, the ranks whose links go through the relay, the connections they have (a dial retried
# through the relay may add one), how the loss is named)
CUTS = {
    "tp2-rank1": (2, 1, "1", 4, ["rank 1 is lost", "no heartbeat"]),
    "pp2-stage1": (1, 2, "1", 3, ["rank 1 is lost", "no heartbeat", "(stage 1)"]),
    "pp3-link1-2": (1, 3, "1-2", 2, ["reports no heartbeat", "link between rank"]),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tmp_path_factory.mktemp("blackhole-beat") / "m"
    cfg = replace(get_preset("tiny-llama").config, num_hidden_layers=3)  # a layer per stage
    make_model_dir(model, "tiny-llama", seed=0, config=cfg)
    return model


def _request(engine, streamed: list | None = None) -> threading.Event:
    done: dict = {}
    ev = threading.Event()

    def on_done(c, e):
        done["result"] = (c, e)
        ev.set()

    engine.generate(
        PROMPT,
        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
        (),
        (streamed if streamed is not None else []).append,
        on_done,
    )
    ev.result = done  # type: ignore[attr-defined]
    return ev


def _first_unhealthy(engine, since: float, stop: threading.Event, out: list) -> None:
    while not stop.wait(0.02):
        ok, why = engine.health()
        if not ok:
            out.append((time.monotonic() - since, why))
            return


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_blackholed_link_is_seen_by_the_heartbeat_and_the_replay_gives_the_same_text(
    tiny, monkeypatch, cut
) -> None:
    from tandem.cli.engine_factory import build_serving_engine

    tp, pp, ranks, n_links, names = CUTS[cut]
    relay = Relay()
    monkeypatch.setenv("TANDEM_SHM", "0")  # the ring's small frames on TCP, through the relay
    monkeypatch.setenv(ENV, relay.route(ranks))
    engine, close = build_serving_engine(
        tiny, tp=tp, pp=pp, max_seq_len=256, op_timeout=OP_TIMEOUT_S,
        heartbeat_timeout=HEARTBEAT_S, reform_timeout=OP_TIMEOUT_S,
    )  # fmt: skip
    stop = threading.Event()
    try:
        ref = _request(engine)
        assert ref.wait(OP_TIMEOUT_S / 2), "the uninterrupted request hung"
        want, error = ref.result["result"]
        assert error is None and len(want.token_ids) == NEW, error
        assert len(relay.destinations) >= n_links, relay.destinations  # data and heartbeats

        streamed: list = []
        got = _request(engine, streamed)
        while not streamed and not got.is_set():  # the generation is under way
            time.sleep(0.005)
        assert relay.blackhole() >= n_links
        t0 = time.monotonic()
        seen: list = []
        watcher = threading.Thread(target=_first_unhealthy, args=(engine, t0, stop, seen))
        watcher.start()
        assert got.wait(OP_TIMEOUT_S / 2), "the cut request hung"
        stop.set()
        watcher.join()
        completion, error = got.result["result"]
        assert error is None, error
        assert seen, "the cut was never seen: the request finished before it?"
        after, why = seen[0]
        print(f"{cut}: unhealthy {after:.2f} s after the cut: {why}")
        assert after <= BOUND_S < OP_TIMEOUT_S / 10, (after, why)
        # both ends of a cut link go silent at once: the head's heartbeat names the loss, or the
        # rank's own loses the head first and it exits with PEER_LOST_EXIT, which the head names
        by_rank = f"code {PEER_LOST_EXIT} (its heartbeat lost" in why
        assert all(n in why for n in names) or by_rank, why
        # the replay: the same tokens and text as the uninterrupted run
        assert completion.token_ids == want.token_ids
        assert completion.text == want.text
        assert engine.scheduler.executor.counts.reforms == 1
        assert engine.health()[0], engine.health()
    finally:
        stop.set()
        close()
        relay.close()


def test_a_blackholed_link_to_a_tp_rank_of_the_next_stage_is_reported_and_named(
    tiny, monkeypatch
) -> None:
    relay = Relay()
    monkeypatch.setenv(ENV, relay.route("1-3"))  # stage 1 -> stage 2's TP rank 1 (global 3)
    cfg = replace(get_preset("tiny-llama").config, num_hidden_layers=3)
    ex = launch_pipeline(
        tiny, plan_stages(cfg, (1, 1, 2)), timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S,
        max_seq_len=64,
    )  # fmt: skip
    try:
        ex.run(Step((StepSequence(0, (1, 2, 3), 0),)))
        assert len(relay.destinations) >= 2, relay.destinations  # the data link and its beat
        assert relay.blackhole() >= 2
        t0 = time.monotonic()
        while ex.health()[0] and time.monotonic() - t0 < OP_TIMEOUT_S / 2:
            time.sleep(0.02)
        after, (ok, why) = time.monotonic() - t0, ex.health()
        print(f"grid: unhealthy {after:.2f} s after the cut: {why}")
        assert not ok and after <= BOUND_S, (after, why)
        assert "reports no heartbeat" in why and "link between rank" in why, why
        assert ("rank 3 is lost" in why and "(stage 2, TP rank 1)" in why) or (
            "rank 1 is lost" in why and "(stage 1)" in why
        ), why
        with pytest.raises(PipelineFailedError, match="heartbeat"):
            ex.run(Step((StepSequence(0, (4,), 3),)))
    finally:
        ex.close()
        relay.close()


def test_a_stage_that_exits_behind_a_blackholed_link_does_not_hold_the_step_to_the_op_timeout(
    tiny, monkeypatch
) -> None:
    """PP=2 with heartbeats off: the stage's links go dark, then the stage process exits (as one
    whose own heartbeat lost the head does, before the head's heartbeat fires). The head sees the
    exit and re-forms; closing the broken pipeline must wake the step still waiting on its dark
    link (held open by the relay, as by a cut cable) instead of leaving it to the 60 s op timeout,
    so the request is replayed and finishes with the uninterrupted text well inside that."""
    import signal

    import psutil

    from tandem.cli.engine_factory import build_serving_engine

    relay = Relay()
    monkeypatch.setenv(ENV, relay.route("1"))
    engine, close = build_serving_engine(
        tiny, pp=2, max_seq_len=256, op_timeout=OP_TIMEOUT_S, heartbeat_timeout=0,
        reform_timeout=OP_TIMEOUT_S,
    )  # fmt: skip
    try:
        ref = _request(engine)
        assert ref.wait(OP_TIMEOUT_S / 2), "the uninterrupted request hung"
        want, error = ref.result["result"]
        assert error is None, error
        stages = [p for p in psutil.Process().children(recursive=True) if "stage" in p.cmdline()]
        assert len(stages) == 1, stages

        streamed: list = []
        got = _request(engine, streamed)
        while not streamed and not got.is_set():  # the generation is under way
            time.sleep(0.005)
        assert relay.blackhole() >= 2  # the head's link to the stage and the stage's link back
        stages[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert got.wait(OP_TIMEOUT_S / 2), "the step waited on its dark link for the op timeout"
        print(f"replayed and finished {time.monotonic() - t0:.2f} s after the stage exited")
        completion, error = got.result["result"]
        assert error is None, error
        assert completion.token_ids == want.token_ids
        assert engine.scheduler.executor.counts.reforms == 1
    finally:
        close()
        relay.close()


def test_a_stage_whose_head_falls_silent_exits_by_its_heartbeat_with_peer_lost_exit(
    tiny, monkeypatch
) -> None:
    """The stage's side of a cut: PP=2 through `launch_pipeline`, every link of stage 1 through
    the relay; the relay goes dark and the head's heartbeat watcher is closed (its close does not
    cross the dark relay), so only the stage's heartbeat can see the silence. The stage declares
    the head lost, leaves, and exits with PEER_LOST_EXIT (what a supervisor names as a heartbeat
    loss, so a head that sees the exit before its own heartbeat fires still reports one), not 1."""
    relay = Relay()
    monkeypatch.setenv(ENV, relay.route("1"))
    cfg = replace(get_preset("tiny-llama").config, num_hidden_layers=3)
    ex = launch_pipeline(
        tiny, plan_stages(cfg, (1, 1)), timeout=OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S,
        max_seq_len=64,
    )  # fmt: skip
    try:
        ex.run(Step((StepSequence(0, (1, 2, 3), 0),)))
        (stage,) = ex.worker_procs
        assert relay.blackhole() >= 3  # the head's link to the stage, its link back, its beat
        ex._heartbeat.close()  # the head stops watching: the stage's heartbeat sees it first
        stage.wait(OP_TIMEOUT_S / 2)
        assert stage.returncode == PEER_LOST_EXIT, stage.returncode
    finally:
        ex.close()
        relay.close()
