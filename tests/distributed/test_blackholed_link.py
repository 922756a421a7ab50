"""A blackholed ring link (the connection stays open and carries nothing, as with a pulled cable
or a sleeping laptop) is seen on both sides within the configured bound, and no process hangs.

A real head (`build_serving_engine` over a RING_CONFIG, as `tandem serve --ring-config` runs it)
and a real `tandem worker` process, over TCP on loopback (same-host shared memory off). The head's
link to its right neighbour (rank 0 -> rank 1, the link every control frame travels) runs through
`BlackholeProxy` (or, in the second case, rank 1's link back to rank 0). After one generation the
proxy goes dark while the group idles:

- the head's ping (a broadcast: the frame goes round, the worker's part comes back) hears nothing
  back, and the worker hears nothing (head-to-worker dark) or nothing after it answered
  (worker-to-head dark): whichever op timeout fires first raises PeerTimeoutError on that side,
  which closes its links at once, and the other side sees it leave (PeerClosedError) if its own
  timeout has not fired yet;
- either way the head's /health source turns unhealthy within op_timeout + 2 keepalive
  intervals, the worker exits (non-zero) within that plus its teardown, and a request sent then
  fails with an error instead of waiting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tcp_proxy import BlackholeProxy
from tp_support import engine_generate, write_ring_configs

from tandem.cluster.launcher import free_ports
from tandem.cluster.ring_config import keepalive_interval
from tandem.loaders.make import make_model_dir

OP_TIMEOUT_S = 3.0
SLACK_S = 3.0  # the polls and the scheduler on a loaded 2-core machine (4.7 s seen under load)
TEARDOWN_S = 6.0  # a worker process that has seen the loss tearing down torch and exiting


def _ring_configs(tmp: Path, dark: int) -> tuple[list[Path], BlackholeProxy]:
    """Rank `dark` dials its right neighbour through the proxy; the other rank dials directly."""
    p0, p1, master = free_ports(3)
    proxy = BlackholeProxy(("127.0.0.1", (p1, p0)[dark]))
    dial = [p1, p0]
    dial[dark] = proxy.port
    files = write_ring_configs(tmp, "blackhole", OP_TIMEOUT_S, dial, (p0, p1, master))
    return files, proxy


# 0: the head's link to the worker (every control frame and ping), 1: the worker's link back
@pytest.mark.parametrize("dark", [0, 1], ids=["head-to-worker", "worker-to-head"])
def test_a_blackholed_link_is_seen_on_both_sides_within_the_bound_and_nothing_hangs(
    tmp_path, monkeypatch, dark
) -> None:
    from tandem.cli.engine_factory import build_serving_engine

    model = tmp_path / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    (ring0, ring1), proxy = _ring_configs(tmp_path, dark)
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
        completion, error = engine_generate(engine)
        assert error is None and completion.completion_tokens == 4, error
        assert proxy.forwarded > 0 and engine.health()[0]

        proxy.blackhole()
        t0 = time.monotonic()
        bound = OP_TIMEOUT_S + 2 * keepalive_interval(OP_TIMEOUT_S) + SLACK_S
        exit_bound = bound + TEARDOWN_S
        head_seen = worker_gone = None
        while time.monotonic() - t0 < exit_bound + 10 and (
            head_seen is None or worker_gone is None
        ):
            now = time.monotonic() - t0
            if head_seen is None and not engine.health()[0]:
                head_seen = now
            if worker_gone is None and worker.poll() is not None:
                worker_gone = now
            time.sleep(0.05)
        _, stderr = worker.communicate(timeout=10)
        print(
            f"blackhole: head saw it at {head_seen} s (bound {bound}), worker exited {worker_gone} s"
        )
        # the worker: out with a typed peer error (whichever side's op timeout fires first, the
        # other sees its peer leave)
        assert worker_gone is not None and worker_gone < exit_bound, (worker_gone, stderr[-2000:])
        assert worker.returncode != 0
        last = stderr.strip().splitlines()[-1]
        assert "PeerTimeoutError" in last or "PeerClosedError" in last, stderr[-2000:]
        # the head: unhealthy within the bound, saying why
        assert head_seen is not None and head_seen < bound, (head_seen, engine.health())
        ok, why = engine.health()
        print(f"head: {why}\nworker: {last}")
        assert not ok and ("closed" in why or "no progress" in why), why
        # a request now fails at once with a reason instead of waiting on the dark link
        t1 = time.monotonic()
        completion, error = engine_generate(engine, wait_s=bound)
        assert error is not None and time.monotonic() - t1 < bound, (completion, error)
        print(f"request: {type(error).__name__}: {str(error).splitlines()[0]}")
    finally:
        proxy.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        if close is not None:
            t2 = time.monotonic()
            close()
            assert time.monotonic() - t2 < OP_TIMEOUT_S + TEARDOWN_S, "closing the head hung"
