"""`tandem cluster join --rejoin`: a worker rank outlives its head. The head's node (its `cluster join`
and the `tandem serve` below it) is killed; the worker's process exits (its model memory with it),
the joined node waits, announces itself to the next head's status board on the same token, and
serves it the same greedy text, while slow-drip clients and a flood hit every port the new head's
node listens on (HTTP and the status board). Real processes on loopback."""

import json
import time

import psutil
import pytest
from hostile_support import HTTP_DRIP, Drip, Flood, listening_ports
from serve_support import TANDEM, complete, kill_tree, make_model, spawn, wait_healthy
from test_cluster_cli import _cli

from tandem.cluster.launcher import free_port_block, free_ports
from tandem.server.http_limits import REQUEST_READ_TIMEOUT_S

RELEASE_BOUND_S = 15.0  # a closed connection is seen at once; then the worker's exit


def _workers(join_pid: int) -> list[psutil.Process]:
    out = []
    for c in psutil.Process(join_pid).children(recursive=True):
        try:
            if "worker" in c.cmdline():
                out.append(c)
        except psutil.Error:
            continue
    return out


# ~100 s on 2 shared cores: two head nodes (each a `cluster join` and a `tandem serve`) and two
# worker processes start and load the model
@pytest.mark.slow
def test_a_joined_worker_frees_its_model_when_the_head_dies_and_joins_the_next_head(tmp_path):
    model = make_model(tmp_path / "model")
    base_port = free_port_block(4)
    token = _cli(
        "cluster",
        "init",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--base-port",
        str(base_port),
        "--no-qr",
    ).stdout.split()[-1]
    (http_port,) = free_ports(1)
    base = f"http://127.0.0.1:{http_port}"

    def join(rank: int, *extra: str):
        argv = [*TANDEM, "cluster", "join", token, "--rank", str(rank), "--model", str(model)]
        argv += ["--config-dir", str(tmp_path / f"n{rank}"), "--port", str(http_port), *extra]
        return spawn(argv)

    procs = [join(1, "--rejoin")]
    try:
        procs.append(join(0))
        wait_healthy(procs[1], base)
        first = complete(base)
        (serving,) = _workers(procs[0].pid)

        t0 = time.monotonic()
        kill_tree(procs[1])  # the head's node is gone: its join, its server
        while serving.is_running() and serving.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - t0 < RELEASE_BOUND_S, "the worker kept its model"
            time.sleep(0.05)
        released_s = time.monotonic() - t0
        time.sleep(2.0)
        assert procs[0].poll() is None and _workers(procs[0].pid) == []  # waiting, no worker

        procs.append(join(0))  # the next head, same token
        wait_healthy(procs[2], base)
        assert complete(base) == first  # and warm: its caches are allocated before the baseline
        # slow drips on every port the head's node listens on (HTTP, the status board) and a
        # flood of each while it generates: the same text, every drip cut, no process grows 10 MB
        head = [procs[2].pid, *(c.pid for c in psutil.Process(procs[2].pid).children(True))]
        ports = listening_ports(head)
        assert http_port in ports and len(ports) >= 2, ports
        rss0 = {pid: psutil.Process(pid).memory_info().rss for pid in head}
        drips = [Drip(p, HTTP_DRIP if p == http_port else b"\x00\x00\x01\x00" * 8) for p in ports]
        for d in drips:
            d.start()
        floods = [Flood(p, 200, b"\x00\x00") for p in ports]
        assert complete(base) == first
        for d in drips:
            d.join(REQUEST_READ_TIMEOUT_S + 5.0)
        assert all(d.error is None and d.cut_after_s is not None for d in drips)
        for f in floods:
            f.stop()
        time.sleep(1.0)
        grown = [psutil.Process(pid).memory_info().rss - rss0[pid] for pid in head]
        print(
            f"ports {ports}: drips cut after {[round(d.cut_after_s, 1) for d in drips]} s, "
            f"RSS grown {[round(g / 2**20, 2) for g in grown]} MB"
        )
        assert max(grown) < 10 << 20
        snap = json.loads(_cli("cluster", "status", token, "--json").stdout)
        assert sorted(x["rank"] for x in snap["ranks"]) == [0, 1]
        print(f"the joined worker's process (its model) was gone {released_s:.2f} s after the head")
    finally:
        for p in procs:
            kill_tree(p)
