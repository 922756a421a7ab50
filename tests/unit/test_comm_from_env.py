"""from_env and RING_CONFIG: the environment picks the backend, and every error names its field."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from tandem.cluster.ring_config import (
    RingConfigError,
    load_ring_config,
    parse_ring_config,
    secret_bytes,
)
from tandem.comm import CommConfigError, from_env
from tandem.comm.env import InsecureBackendError
from tandem.comm.solo import SoloCommunicator

GOOD = {"master_ip": None, "master_port": 9002, "port": 9000, "right_ip": "192.168.77.2",
        "right_port": 9001, "rank": 0, "world_size": 2}  # fmt: skip


def test_paper_ring_config_parses() -> None:
    cfg = parse_ring_config(GOOD)
    assert (cfg.rank, cfg.world_size, cfg.port, cfg.right_ip, cfg.right_port) == (
        0,
        2,
        9000,
        "192.168.77.2",
        9001,
    )
    assert cfg.master_ip is None and cfg.master_port == 9002 and cfg.wire_dtype == "float32"
    # a secured multi-host rank listens on its address toward its right neighbour (from_env
    # finds it), never on every interface; an unsecured one stays on loopback
    assert cfg.bind_ip(has_secret=True) is None and cfg.bind_ip(has_secret=False) == "127.0.0.1"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rank": 2}, "rank"),
        ({"rank": "0"}, "rank"),
        ({"right_port": 70000}, "right_port"),
        ({"port": None}, "port"),
        ({"right_ip": 5}, "right_ip"),
        ({"world_size": 0}, "world_size"),
        ({"wire_dtype": "int8"}, "wire_dtype"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_ring_config_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(RingConfigError, match=field):
        parse_ring_config({**GOOD, **change})


def test_ring_config_file_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "ring.json"
    p.write_text("{not json")
    with pytest.raises(RingConfigError, match="ring.json.*not valid JSON"):
        load_ring_config(p)
    with pytest.raises(RingConfigError, match="cannot read"):
        load_ring_config(tmp_path / "missing.json")


def test_secret_text_is_hex_when_it_parses_else_utf8() -> None:
    assert secret_bytes("00ff") == b"\x00\xff" and secret_bytes("pass word") == b"pass word"
    assert secret_bytes("") is None and secret_bytes(None) is None


def test_from_env_without_a_cluster_is_solo() -> None:
    assert isinstance(from_env({}), SoloCommunicator)
    assert isinstance(from_env({"RANK": "0", "WORLD_SIZE": "1"}), SoloCommunicator)


@pytest.mark.parametrize(
    "env, name",
    [
        ({"TANDEM_COMM": "mpi"}, "TANDEM_COMM"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK"),
        (
            {
                "TANDEM_COMM": "ring",
                "RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "RING_CONFIG",
        ),
    ],
)
def test_from_env_errors_name_the_variable(env: dict, name: str) -> None:
    with pytest.raises(CommConfigError, match=name):
        from_env(env)


def test_from_env_reports_ring_config_field_errors(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text(json.dumps({**GOOD, "right_port": "x"}))
    with pytest.raises(CommConfigError, match="right_port"):
        from_env({"RING_CONFIG": str(p)})


def test_nccl_refused_without_cuda() -> None:
    from tandem.comm.torchdist import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="CUDA"):
        from_env(
            {
                "TANDEM_COMM": "nccl",
                "TANDEM_INSECURE_COMM": "1",
                "RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1",
            }
        )


GLOO = {"TANDEM_COMM": "gloo", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1"}  # fmt: skip


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_gloo_and_nccl_are_refused_without_the_insecure_opt_in_even_on_loopback(backend) -> None:
    """Their store takes writes from any local user and the secret is unused: refused at once,
    naming the variable that runs it anyway."""
    t0 = time.monotonic()
    with pytest.raises(InsecureBackendError, match="TANDEM_INSECURE_COMM=1") as e:
        from_env({**GLOO, "TANDEM_COMM": backend})
    assert "not authenticated" in str(e.value) and "secret is unused" in str(e.value)
    assert isinstance(e.value, CommConfigError)
    assert time.monotonic() - t0 < 1


def test_the_opt_in_warns_that_the_store_is_unauthenticated(caplog) -> None:
    """Opted in, gloo goes on (here to the beyond-loopback refusal, which still stands without a
    trusted network) after a warning naming the store."""
    from tandem.comm.torchdist import UntrustedNetworkError

    env = {**GLOO, "MASTER_ADDR": "192.0.2.7", "TANDEM_INSECURE_COMM": "1"}
    with caplog.at_level(logging.WARNING), pytest.raises(UntrustedNetworkError):
        from_env(env)
    assert "192.0.2.7:1 is not authenticated" in caplog.text
