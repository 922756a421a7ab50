"""Ranks listen where they were told, never on every interface: a ring rank from a join token on
its own host address, a hand-written secured RING_CONFIG on its address toward its right
neighbour, a `tandem worker --peers` rank on its own peer address, and torch.distributed's store
(gloo) on the master address alone; gloo beyond loopback is refused unless the network is
declared trusted. Real sockets, inspected with psutil while the ranks wait for each other."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from comm_harness import _free_port, run_world

from tandem.cluster.token import new_topology
from tandem.comm import from_env
from tandem.comm.env import facing_address
from tandem.comm.torchdist import TorchDistCommunicator, UntrustedNetworkError


def _listening(port: int, timeout_s: float = 10.0) -> set[str]:
    """The addresses this process listens on at `port` (waits until there is one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = {
            c.laddr.ip
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _form_in_threads(make_rank, world: int, check_port: int) -> set[str]:
    """Starts rank 0, reads where it listens while it waits, then starts the rest."""
    comms: dict = {}

    def run(r: int) -> None:
        comms[r] = make_rank(r)

    threads = [threading.Thread(target=run, args=(0,), daemon=True)]
    threads[0].start()
    seen = _listening(check_port)
    for r in range(1, world):
        threads.append(threading.Thread(target=run, args=(r,), daemon=True))
        threads[-1].start()
    for th in threads:
        th.join(60)
    assert len(comms) == world, "the ring did not form"
    for c in comms.values():
        c.close()
    return seen


def test_a_token_ring_rank_listens_on_its_own_host_address_only(tmp_path: Path) -> None:
    topo = new_topology(["127.0.0.2", "127.0.0.3"], 2, 1, base_port=_free_port())
    files = []
    for r in range(2):
        f = tmp_path / f"ring{r}.json"
        f.write_text(json.dumps({**topo.ring_config(r), "handshake_timeout": 30}))
        files.append(f)

    def rank(r: int):
        return from_env({"RING_CONFIG": str(files[r]), "TANDEM_SHM": "0"})

    assert _form_in_threads(rank, 2, topo.port_of(0)) == {"127.0.0.2"}


def _own_non_loopback_ipv4() -> str | None:
    for entries in psutil.net_if_addrs().values():
        for e in entries:
            if e.family == socket.AF_INET and not e.address.startswith("127."):
                return e.address
    return None


def test_a_secured_hand_written_ring_config_listens_toward_its_neighbour(tmp_path: Path) -> None:
    """No listen_ip: the rank listens on its address on the route to its right neighbour (here
    this host's own LAN address, which both ranks dial), not on 0.0.0.0."""
    lan = _own_non_loopback_ipv4()
    if lan is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    p0, p1 = _free_port(), _free_port()
    files = []
    for r, (port, right) in enumerate([(p0, p1), (p1, p0)]):
        cfg = {"rank": r, "world_size": 2, "port": port, "right_ip": lan,
               "right_port": right, "secret": "ab" * 16, "handshake_timeout": 30}  # fmt: skip
        f = tmp_path / f"ring{r}.json"
        f.write_text(json.dumps(cfg))
        files.append(f)

    def rank(r: int):
        return from_env({"RING_CONFIG": str(files[r]), "TANDEM_SHM": "0"})

    assert facing_address(lan) == lan
    assert _form_in_threads(rank, 2, p0) == {lan}


def test_a_worker_from_peers_listens_on_its_own_peer_address() -> None:
    from tandem.cli.worker import ring_from_args

    ports = [_free_port(), _free_port()]
    peers = [("127.0.0.2", ports[0]), ("127.0.0.3", ports[1])]

    def rank(r: int):
        return ring_from_args(r, 2, peers, b"s" * 16, op_timeout=10, handshake_timeout=30)

    assert _form_in_threads(rank, 2, ports[0]) == {"127.0.0.2"}


def _store_listens_on(comm, port: int) -> list[str]:
    return sorted(_listening(port, timeout_s=2.0)) if comm.rank == 0 else []


def test_gloos_store_listens_on_the_master_address_alone() -> None:
    port = _free_port()
    env = [
        {
            "TANDEM_COMM": "gloo",
            "TANDEM_INSECURE_COMM": "1",
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.2",
            "MASTER_PORT": str(port),
        }  # fmt: skip
        for r in range(2)
    ]
    results = run_world("env", 2, _store_listens_on, (port,), options={"env": env}, timeout=120)
    assert results[0] == ["127.0.0.2"]


def test_gloo_beyond_loopback_is_refused_unless_the_network_is_declared_trusted() -> None:
    t0 = time.monotonic()
    with pytest.raises(UntrustedNetworkError, match="not authenticated.*TANDEM_TRUSTED_NETWORK"):
        TorchDistCommunicator.create(0, 2, master=("192.0.2.7", 29999), backend="gloo")
    env = {"TANDEM_COMM": "gloo", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "192.0.2.7",
           "MASTER_PORT": "29999", "TANDEM_INSECURE_COMM": "1"}  # fmt: skip
    with pytest.raises(UntrustedNetworkError):
        from_env(env)
    assert time.monotonic() - t0 < 5  # refused before any network wait
