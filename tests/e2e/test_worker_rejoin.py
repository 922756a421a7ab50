"""The head killed: a `tandem worker --rejoin` drops back to waiting for a head, gives its model
memory back when its worker process exits, does not crash-loop, and serves the next head with the
same greedy text. Real processes on loopback: `tandem serve --ring-config` heads (SIGKILLed, then
started again on the same RING_CONFIG) and one `tandem worker --rejoin` over TCP. While the worker waits for the next head, a stranger
drips HELLOs and floods its ring port: the ring still forms, and the pre-auth deadline and the
per-host cap bound what the stranger holds."""

import json
import os
import signal
import time

import psutil
import pytest
from hostile_support import FRAME_DRIP, Drip, Flood, listening_ports
from serve_support import TANDEM, complete, kill_tree, make_model, spawn, wait_healthy
from tp_support import write_ring_configs

from tandem.cluster.launcher import free_ports
from tandem.transport.endpoints import MAX_PENDING_PER_HOST, PREAUTH_DEADLINE_S

OP_TIMEOUT_S = 4.0
RELEASE_BOUND_S = OP_TIMEOUT_S + 6.0  # seen at once (a closed connection); then the exit itself
SUPERVISOR_MAX_RSS = 64 << 20  # a Python process without torch
STRANGER = "127.0.0.2"


def _head(model, ring0, env):
    (port,) = free_ports(1)
    argv = [*TANDEM, "serve", "--model", str(model), "--ring-config", str(ring0)]
    proc = spawn([*argv, "--port", str(port)], env=env)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, timeout_s=120)
    return proc, base


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children()


def _rss(p: psutil.Process) -> int:
    return p.memory_info().rss


# ~35 s on 2 shared cores: two heads and two worker processes start and load the model
@pytest.mark.slow
def test_a_rejoining_worker_frees_its_model_when_the_head_is_killed_and_serves_the_next_head(
    tmp_path,
):
    model = make_model(tmp_path / "model")
    ring0, ring1 = write_ring_configs(tmp_path, "rejoin", OP_TIMEOUT_S)
    env = {**os.environ, "TANDEM_SHM": "0"}
    worker = spawn(
        [*TANDEM, "worker", "--model", str(model), "--rejoin"], {**env, "RING_CONFIG": str(ring1)}
    )
    heads = []
    try:
        head, base = _head(model, ring0, env)
        heads.append(head)
        first = complete(base)
        supervisor = psutil.Process(worker.pid)  # `--rejoin` exec'd the supervisor in place
        (serving,) = _children(worker.pid)
        loaded = _rss(serving)

        head.send_signal(signal.SIGKILL)
        head.wait(10)
        t0 = time.monotonic()
        while serving.is_running() and serving.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - t0 < RELEASE_BOUND_S, "the worker kept its model"
            time.sleep(0.05)
        released_s = time.monotonic() - t0
        time.sleep(3.0)  # waiting for a head: one new child, started once, not a crash loop
        (waiting,) = _children(worker.pid)
        assert waiting.pid != serving.pid and waiting.is_running()
        time.sleep(2.0)
        assert [c.pid for c in _children(worker.pid)] == [waiting.pid]
        between = _rss(supervisor)
        print(
            f"model memory released {released_s:.2f} s after the head was killed; worker RSS "
            f"serving {loaded / 2**20:.0f} MB, supervisor between heads {between / 2**20:.0f} MB, "
            f"its waiting child {_rss(waiting) / 2**20:.0f} MB"
        )
        assert between < SUPERVISOR_MAX_RSS
        assert worker.poll() is None

        # a stranger (another loopback address) drips HELLOs and floods the waiting worker's
        # ring port while the next head forms the ring through it
        ring_port = json.loads(ring1.read_text())["port"]
        t1 = time.monotonic()
        while ring_port not in listening_ports([waiting.pid]):
            assert time.monotonic() - t1 < 60, "the waiting worker never listened"
            time.sleep(0.1)
        rss0 = _rss(waiting)
        drips = [Drip(ring_port, FRAME_DRIP, source=STRANGER) for _ in range(2)]
        for d in drips:
            d.start()
        flood = Flood(ring_port, 100, FRAME_DRIP[:8], source=STRANGER)
        t_attack = time.monotonic()
        time.sleep(1.0)
        grown = _rss(waiting) - rss0  # before the head comes and the shard loads
        held_early = flood.open_count()  # the listener closes all past its per-address cap
        head, base = _head(model, ring0, env)  # the next head, same ring
        heads.append(head)
        assert complete(base) == first
        assert [c.pid for c in _children(worker.pid)] == [waiting.pid]
        cut_by = PREAUTH_DEADLINE_S + 5.0
        for d in drips:
            d.join(max(0.0, cut_by - (time.monotonic() - t_attack)))
        held = flood.open_count()
        print(
            f"drips cut after {[d.cut_after_s for d in drips]} s; flood of {len(flood.socks)} "
            f"({flood.refused} refused), {held_early} held at 1 s, {held} after the deadline; "
            f"the waiting worker grew "
            f"{grown / 2**20:.1f} MB under the flood"
        )
        assert [d.error for d in drips] == [None, None]
        assert all(d.cut_after_s is not None and d.cut_after_s < cut_by for d in drips)
        assert len(flood.socks) >= 50 and held_early <= MAX_PENDING_PER_HOST  # rest closed unread
        assert held == 0  # and those it held, cut at the pre-auth deadline
        assert grown < 10 << 20
        flood.stop()
    finally:
        for p in [*heads, worker]:
            kill_tree(p)
