"""A blackholed ring link (the connection stays open and carries nothing, as with a pulled cable
or a sleeping laptop) is seen on both sides within the configured bound, and no process hangs.

A real head (`build_serving_engine` over a RING_CONFIG, as `tandem serve --ring-config` runs it)
and a real `tandem worker` process, over TCP on loopback (same-host shared memory off). The head's
link to its right neighbour (rank 0 -> rank 1, the link every control frame travels) runs through
`BlackholeProxy`; rank 1's link back to rank 0 is direct. After one generation the proxy goes
dark while the group idles:

- the worker, blocked on the next control frame, hears nothing (not even the head's pings) and
  leaves at its op timeout with a typed communicator error and a non-zero exit code;
- the head's pings are refused once the worker is gone (or time out if it were still there): its
  /health source turns unhealthy within op_timeout + 2 keepalive intervals, and a request sent
  then fails with an error instead of waiting.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from tcp_proxy import BlackholeProxy
from test_idle_group_liveness import _ports

from tandem.cluster.ring_config import keepalive_interval
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.make import make_model_dir

OP_TIMEOUT_S = 3.0
SLACK_S = 5.0  # a loaded 2-core machine: the worker tearing down torch and exiting, the poll


def _ring_configs(tmp: Path) -> tuple[list[Path], BlackholeProxy]:
    p0, p1, master = _ports(3)
    proxy = BlackholeProxy(("127.0.0.1", p1))
    secret = secrets.token_hex(32)
    files = []
    # rank 0 dials rank 1 through the proxy; rank 1 dials rank 0 directly
    for rank, (port, right) in enumerate([(p0, proxy.port), (p1, p0)]):
        cfg = {
            "rank": rank, "world_size": 2, "port": port, "right_ip": "127.0.0.1",
            "right_port": right, "master_ip": None if rank == 0 else "127.0.0.1",
            "master_port": master, "secret": secret, "cluster_id": "blackhole",
            "op_timeout": OP_TIMEOUT_S, "handshake_timeout": 60,
        }  # fmt: skip
        f = tmp / f"ring{rank}.json"
        f.write_text(json.dumps(cfg))
        files.append(f)
    return files, proxy


def _generate(engine, n: int = 4, wait_s: float = 30.0) -> tuple:
    done: dict = {}
    ev = threading.Event()

    def on_done(c, e):
        done["result"] = (c, e)
        ev.set()

    engine.generate(
        [1, 2, 3], SamplingParams(max_tokens=n, temperature=0), (), lambda d: None, on_done
    )
    assert ev.wait(wait_s), "generation hung"
    return done["result"]


def test_a_blackholed_link_is_seen_on_both_sides_within_the_bound_and_nothing_hangs(
    tmp_path, monkeypatch
) -> None:
    from tandem.cli.engine_factory import build_serving_engine

    model = tmp_path / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    (ring0, ring1), proxy = _ring_configs(tmp_path)
    monkeypatch.setenv("TANDEM_SHM", "0")
    env = {**os.environ, "RING_CONFIG": str(ring1), "TANDEM_SHM": "0"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tandem", "worker", "--model", str(model)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    close = None
    try:
        engine, close = build_serving_engine(model, ring_config=ring0, max_seq_len=64)
        completion, error = _generate(engine)
        assert error is None and completion.completion_tokens == 4, error
        assert proxy.forwarded > 0 and engine.health()[0]

        proxy.blackhole()
        t0 = time.monotonic()
        bound = OP_TIMEOUT_S + 2 * keepalive_interval(OP_TIMEOUT_S) + SLACK_S
        head_seen = worker_gone = None
        while time.monotonic() - t0 < bound + 10 and (head_seen is None or worker_gone is None):
            now = time.monotonic() - t0
            if head_seen is None and not engine.health()[0]:
                head_seen = now
            if worker_gone is None and worker.poll() is not None:
                worker_gone = now
            time.sleep(0.05)
        _, stderr = worker.communicate(timeout=10)
        print(f"blackhole seen: head {head_seen} s, worker exited {worker_gone} s (bound {bound})")
        # the worker: out at its op timeout, with a typed error naming the silent peer
        assert worker_gone is not None and worker_gone < bound, (worker_gone, stderr[-2000:])
        assert worker.returncode != 0
        assert "Error" in stderr and ("timeout" in stderr.lower() or "progress" in stderr), stderr[
            -2000:
        ]
        # the head: unhealthy within the bound, saying why
        assert head_seen is not None and head_seen < bound, (head_seen, engine.health())
        ok, why = engine.health()
        print(f"head: {why}\nworker: {stderr.strip().splitlines()[-1]}")
        assert not ok and why, why
        # a request now fails at once with a reason instead of waiting on the dark link
        t1 = time.monotonic()
        completion, error = _generate(engine, wait_s=bound)
        assert error is not None and time.monotonic() - t1 < bound, (completion, error)
    finally:
        proxy.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        if close is not None:
            t2 = time.monotonic()
            close()
            assert time.monotonic() - t2 < OP_TIMEOUT_S + SLACK_S, "closing the head hung"
