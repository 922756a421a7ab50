"""An idle tensor-parallel group whose op timeout is shorter than any fixed keepalive stays alive
(its pings follow the op timeout), and a worker that hangs while the group idles (SIGSTOP) is
seen within op_timeout + 2 keepalive intervals: /health's source turns unhealthy. A real head
(`build_serving_engine` over a RING_CONFIG, as `tandem serve --ring-config` runs it) and a real
`tandem worker` process on loopback, over TCP as between two machines (same-host shared memory
off; its wait is bounded by the op timeout on its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tp_support import engine_generate, write_ring_configs

from tandem.cluster.ring_config import keepalive_interval
from tandem.loaders.make import make_model_dir

OP_TIMEOUT_S = (
    4.0  # well below the 5 s keepalive the server used to ping at, whatever the op timeout
)


def test_an_idle_group_outlives_a_short_op_timeout_and_a_hung_worker_is_seen_in_bound(
    tmp_path, monkeypatch
) -> None:
    from tandem.cli.engine_factory import build_serving_engine

    model = tmp_path / "m"
    make_model_dir(model, "tiny-llama", seed=0)
    ring0, ring1 = write_ring_configs(tmp_path, "idle", OP_TIMEOUT_S)
    monkeypatch.setenv("TANDEM_SHM", "0")
    env = {**os.environ, "RING_CONFIG": str(ring1), "TANDEM_SHM": "0"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tandem", "worker", "--model", str(model)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    close = None
    try:
        engine, close = build_serving_engine(model, ring_config=ring0, max_seq_len=64)
        assert engine_generate(engine)[1] is None
        time.sleep(2 * OP_TIMEOUT_S)  # idle two op timeouts: only the pings keep it whole
        completion, error = engine_generate(engine)
        assert error is None and completion.completion_tokens == 4, error
        assert worker.poll() is None and engine.health()[0]

        worker.send_signal(signal.SIGSTOP)  # hung, not dead: its sockets stay open
        t0 = time.monotonic()
        bound = OP_TIMEOUT_S + 2 * keepalive_interval(OP_TIMEOUT_S)
        while engine.health()[0] and time.monotonic() - t0 < bound + 10:
            time.sleep(0.05)
        seen_after = time.monotonic() - t0
        ok, why = engine.health()
        assert not ok and seen_after < bound + 2.0, (seen_after, bound, why)
        assert "progress" in why or "timeout" in why.lower() or "closed" in why, why
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.kill()
        worker.wait(10)
        if close is not None:
            close()
