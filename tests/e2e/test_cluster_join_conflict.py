"""A second `tandem cluster join` for a rank a live node holds is refused in one line, and the
status board keeps the first node's row. Real processes on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

from tandem.cluster.launcher import free_port_block
from tandem.cluster.status import StatusError, query
from tandem.cluster.token import encode_token, new_topology

TANDEM = [sys.executable, "-m", "tandem"]


def test_a_second_join_for_an_occupied_rank_is_refused_and_the_first_row_kept(tmp_path):
    topo = new_topology(["127.0.0.1"] * 2, 2, 1, base_port=free_port_block(4))
    token = encode_token(topo)

    def rows() -> dict:
        snap = query("127.0.0.1", topo.status_port, topo.secret)
        return {r["rank"]: r for r in snap["ranks"]}

    def join(rank: int, name: str) -> subprocess.Popen:
        argv = [*TANDEM, "cluster", "join", token, "--rank", str(rank), "--timeout", "60"]
        argv += ["--config-dir", str(tmp_path / name)]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [join(0, "head"), join(1, "first")]
    try:
        deadline = time.time() + 60
        while True:
            try:
                if len(rows()) == 2:
                    break
            except StatusError:
                pass
            assert time.time() < deadline, "the first join never showed on the board"
            time.sleep(0.3)
        second = join(1, "second")
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        last = err.strip().splitlines()[-1]
        assert last.startswith("tandem cluster join: error:") and "rank 1 is already joined" in last
        assert rows()[1]["pid"] == procs[1].pid and rows()[1]["alive"] is True
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
