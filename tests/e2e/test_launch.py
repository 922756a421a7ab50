"""`tandem launch` brings a local cluster up, and Ctrl-C or a dead rank takes every process down."""

import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
from serve_support import (
    TANDEM,
    descendants,
    health,
    kill_tree,
    make_model,
    output,
    spawn,
    wait_healthy,
)

from tandem.cluster.launcher import check_port_free, free_ports

TP = int(os.environ.get("TANDEM_TEST_SERVE_TP", "2"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("launch") / "model")


def _launch(model, port, sigint_ignored=False, extra=()):
    """`sigint_ignored`: start it as a non-interactive shell starts a background job, with
    SIGINT ignored, which Ctrl-C must still stop."""
    argv = [*TANDEM, "launch", "--model", str(model), "--tp", str(TP), "--port", str(port)]
    argv += list(extra)
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return spawn([*argv, "--no-demo"], preexec_fn=ignore)


def _long_stream(port, chunks):
    import json
    import urllib.request

    body = {
        "model": "model",
        "prompt": "Once",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                chunks.append(line)
    except OSError:
        pass


def _all_gone(procs, timeout_s=30.0):
    gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_launch_then_sigint_leaves_no_process_and_frees_the_port(model):
    (port,) = free_ports(1)
    proc = _launch(model, port, sigint_ignored=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        children = descendants(proc.pid)
        assert len(children) >= TP  # the head and its ranks, each a real process
        chunks: list[bytes] = []
        stream = threading.Thread(target=_long_stream, args=(port, chunks), daemon=True)
        stream.start()  # an open SSE stream must not hold the shutdown up
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(60) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit 60 s after Ctrl-C:\n{output(proc)[-3000:]}") from None
        assert len(chunks) > 2  # the stream was live when Ctrl-C came
        assert _all_gone(children) == []
        check_port_free("127.0.0.1", port)
    finally:
        kill_tree(proc)


def test_a_rank_that_dies_takes_the_whole_cluster_down(model):
    """Without re-forming (`--reform-timeout 0`); with it, see test_launch_recovery.py."""
    (port,) = free_ports(1)
    proc = _launch(model, port, extra=["--reform-timeout", "0"])
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        children = descendants(proc.pid)
        workers = [c for c in children if "worker" in c.cmdline()]
        victim = workers[0] if workers else children[0]  # a worker rank when TP > 1, else the head
        victim.kill()
        assert proc.wait(90) == 1
        assert _all_gone(children) == []
        assert health(f"http://127.0.0.1:{port}") == 0
    finally:
        kill_tree(proc)


def test_launch_refuses_a_port_in_use_in_one_line(model):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.time()
        out = subprocess.run(
            [*TANDEM, "launch", "--model", str(model), "--port", str(port), "--no-demo"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2 and time.time() - t0 < 60
    assert f"port {port}" in out.stderr and "in use" in out.stderr
    assert out.stderr.strip().count("\n") == 0
