"""A tensor-parallel head sees a hung worker by its heartbeat, idle or mid-step, within the
heartbeat timeout and far below the op timeout (set to 60 s here, so the heartbeat is what saw
it). A real head (`build_serving_engine` over a RING_CONFIG, as `tandem serve --ring-config`
runs it, re-form off so the loss ends the group) and a real `tandem worker` process on loopback,
over TCP and over same-host shared memory. The worker is SIGSTOPped: every socket stays open and
silent, as behind a blackholed link."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from tp_support import engine_generate, stop_mid_generation, write_ring_configs

from tandem.loaders.make import make_model_dir

OP_TIMEOUT_S = 60.0
HEARTBEAT_S = 2.0
BOUND_S = 2 * HEARTBEAT_S  # timeout + one beat interval + a loaded 2-core machine's slack


def _group(tmp_path, monkeypatch, shm: bool):
    from tandem.cli.engine_factory import build_serving_engine

    model = tmp_path / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    ring0, ring1 = write_ring_configs(tmp_path, "beat", OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S)
    monkeypatch.setenv("TANDEM_SHM", "1" if shm else "0")
    env = {**os.environ, "RING_CONFIG": str(ring1), "TANDEM_SHM": "1" if shm else "0"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tandem", "worker", "--model", str(model)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engine, close = build_serving_engine(model, ring_config=ring0, max_seq_len=256)
    return worker, engine, close


def _wait_unhealthy(engine, limit_s: float) -> tuple[float, str]:
    t0 = time.monotonic()
    while engine.health()[0] and time.monotonic() - t0 < limit_s:
        time.sleep(0.02)
    return time.monotonic() - t0, engine.health()[1]


def _stop(worker: subprocess.Popen) -> None:
    worker.send_signal(signal.SIGCONT)
    worker.kill()
    worker.wait(10)


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_hung_worker_of_an_idle_group_is_seen_by_its_heartbeat(
    tmp_path, monkeypatch, shm
) -> None:
    worker, engine, close = _group(tmp_path, monkeypatch, shm)
    try:
        assert engine_generate(engine)[1] is None
        time.sleep(2 * HEARTBEAT_S)  # idle past the heartbeat timeout: the beats keep it whole
        assert engine.health()[0], engine.health()
        worker.send_signal(signal.SIGSTOP)
        seen_after, why = _wait_unhealthy(engine, OP_TIMEOUT_S)
        assert not engine.health()[0]
        assert seen_after <= BOUND_S < OP_TIMEOUT_S / 10, (seen_after, why)
        assert "rank 1 is lost" in why and "heartbeat" in why, why
    finally:
        _stop(worker)
        close()


def test_a_worker_hung_mid_generation_fails_the_step_by_its_heartbeat(
    tmp_path, monkeypatch
) -> None:
    worker, engine, close = _group(tmp_path, monkeypatch, False)
    try:
        assert engine_generate(engine)[1] is None
        why = stop_mid_generation(engine, worker, OP_TIMEOUT_S, BOUND_S)
        assert "rank 1" in why, why
    finally:
        _stop(worker)
        close()


def test_a_worker_whose_head_hangs_exits_by_its_heartbeat_with_peer_lost_exit(tmp_path) -> None:
    """The other direction, both ends real `tandem` processes: the head (`tandem serve
    --ring-config`) is SIGSTOPped; the worker's heartbeat loses it and the worker exits with
    PEER_LOST_EXIT (what a supervisor names as a heartbeat loss), within the bound plus its exit."""
    from tandem.cluster.exits import PEER_LOST_EXIT
    from tandem.cluster.launcher import free_ports

    model = tmp_path / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    ring0, ring1 = write_ring_configs(tmp_path, "beat", OP_TIMEOUT_S, heartbeat_timeout=HEARTBEAT_S)
    env = {**os.environ, "TANDEM_SHM": "0"}
    (port,) = free_ports(1)
    serve = [sys.executable, "-m", "tandem", "serve", "--model", str(model), "--port", str(port)]
    head = subprocess.Popen(
        [*serve, "--ring-config", str(ring0), "--max-seq-len", "64"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "tandem", "worker", "--model", str(model)],
        env={**env, "RING_CONFIG": str(ring1)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the group is whole: the head answers /health 200
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert worker.poll() is None and head.poll() is None
            time.sleep(0.2)
        else:
            raise AssertionError("the group never came up")
        head.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        _, stderr = worker.communicate(timeout=OP_TIMEOUT_S / 2)
        gone = time.monotonic() - t0
        assert worker.returncode == PEER_LOST_EXIT, (worker.returncode, stderr[-2000:])
        assert "PeerLostError" in stderr and gone < BOUND_S + 10, (gone, stderr[-2000:])
    finally:
        head.send_signal(signal.SIGCONT)
        head.kill()
        head.wait(10)
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
