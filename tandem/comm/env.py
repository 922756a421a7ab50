"""`from_env()`: the communicator the process environment describes.

    TANDEM_COMM     ring (default) | star | gloo | nccl
    RING_CONFIG     path of the paper's JSON file (see tandem.cluster.ring_config), or else
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT   torchrun's variables (star, gloo, nccl)
    TANDEM_SECRET   the cluster secret when the file has no "secret" field (hex, else UTF-8)
    TANDEM_WIRE_DTYPE, TANDEM_CLUSTER_ID   optional overrides
    TANDEM_INSECURE_COMM=1     lets gloo / nccl run at all: torch.distributed's store and links
                    are not authenticated and ignore the secret (ring and star are), so any user
                    of the machine can write the store; refused without it, warned with it
    TANDEM_TRUSTED_NETWORK=1   lets gloo / nccl rendezvous beyond loopback (and implies the above)

A ring rank listens on RING_CONFIG's listen_ip (the join token writes each rank's own address
there), else on loopback when the ring stays on this host or has no secret, else on this host's
address toward its right neighbour: never on every interface unless listen_ip says "0.0.0.0".

No RING_CONFIG and no RANK/WORLD_SIZE, or a world size of 1, gives the SoloCommunicator.
Every error is a CommConfigError naming the variable or field at fault.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from tandem.cluster.ring_config import RingConfig, RingConfigError, load_ring_config, secret_bytes
from tandem.comm.base import CommError, Communicator
from tandem.comm.solo import SoloCommunicator

BACKENDS = ("ring", "star", "gloo", "nccl")
INSECURE_ENV = "TANDEM_INSECURE_COMM"
TRUSTED_ENV = "TANDEM_TRUSTED_NETWORK"

log = logging.getLogger(__name__)


class CommConfigError(CommError, ValueError):
    """The environment does not describe a usable communicator; the message names the variable."""


class InsecureBackendError(CommConfigError):
    """gloo / nccl asked for without TANDEM_INSECURE_COMM=1: their rendezvous store takes reads
    and writes from anyone who reaches it, and the cluster secret plays no part."""


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise CommConfigError(f"{name} is required (torchrun-style launch) but is not set")
    try:
        return int(raw)
    except ValueError:
        raise CommConfigError(f"{name} must be an integer, got {raw!r}") from None


def _torchrun(env: Mapping[str, str]) -> RingConfig:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if world < 1 or not 0 <= rank < world:
        raise CommConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    addr = env.get("MASTER_ADDR")
    if world > 1 and not addr:
        raise CommConfigError("MASTER_ADDR is required when WORLD_SIZE > 1")
    port = _int(env, "MASTER_PORT") if world > 1 else 1
    return RingConfig(rank, world, 0, "", 0, master_ip=addr, master_port=port)


def from_env(
    environ: Mapping[str, str] | None = None,
    *,
    model_fingerprint: str = "",
    handshake_timeout: float | None = None,
    heartbeat_timeout: float | None = None,
) -> Communicator:
    """Build (and connect) the communicator described by `environ` (default: os.environ).
    `handshake_timeout`: the bound on forming the group, in place of the file's;
    `heartbeat_timeout`: a ring's heartbeat timeout (`transport.heartbeat`), in place of the
    file's `heartbeat_timeout`."""
    env = os.environ if environ is None else environ
    backend = env.get("TANDEM_COMM", "ring").strip().lower()
    if backend not in BACKENDS:
        raise CommConfigError(
            f"TANDEM_COMM={backend!r} is not a backend; choose one of {', '.join(BACKENDS)}"
        )
    if env.get("RING_CONFIG"):
        try:
            cfg = load_ring_config(env["RING_CONFIG"])
        except RingConfigError as e:
            raise CommConfigError(str(e)) from None
        from_file = True
    elif "RANK" in env or "WORLD_SIZE" in env:
        cfg, from_file = _torchrun(env), False
    else:
        return SoloCommunicator()
    if cfg.world_size == 1:
        return SoloCommunicator()
    secret = secret_bytes(cfg.secret or env.get("TANDEM_SECRET"))
    wire = env.get("TANDEM_WIRE_DTYPE", cfg.wire_dtype)
    cluster_id = env.get("TANDEM_CLUSTER_ID", cfg.cluster_id)
    common = dict(
        secret=secret,
        cluster_id=cluster_id,
        wire_dtype=wire,
        model_fingerprint=model_fingerprint,
        handshake_timeout=handshake_timeout or cfg.handshake_timeout,
        op_timeout=cfg.op_timeout,
    )
    if backend == "ring":
        if not from_file:
            raise CommConfigError(
                "TANDEM_COMM=ring needs RING_CONFIG (port, right_ip, right_port); torchrun's "
                "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT describe only a master: use "
                "TANDEM_COMM=star or gloo with them"
            )
        from tandem.comm.ring import RingCommunicator

        listen = cfg.bind_ip(secret is not None) or facing_address(cfg.right_ip)
        return RingCommunicator.create(
            cfg.rank,
            cfg.world_size,
            right=(cfg.right_ip, cfg.right_port),
            listen=(listen, cfg.port),
            heartbeat_timeout=cfg.heartbeat_timeout
            if heartbeat_timeout is None
            else heartbeat_timeout,
            **common,
        )
    master = _master(cfg)
    if backend == "star":
        from tandem.comm.star import StarCommunicator

        if cfg.rank == 0:
            master = (cfg.listen_ip or master[0], master[1])
        return StarCommunicator.create(
            cfg.rank,
            cfg.world_size,
            root=master,
            heartbeat_timeout=cfg.heartbeat_timeout
            if heartbeat_timeout is None
            else heartbeat_timeout,
            **common,
        )
    if cfg.rank == 0:  # its store listens here, reachable by the others
        master = (cfg.listen_ip or master[0], master[1])
    _accept_unauthenticated(env, backend, master)
    from tandem.comm.torchdist import TorchDistCommunicator

    return TorchDistCommunicator.create(
        cfg.rank,
        cfg.world_size,
        master=master,
        backend=backend,
        timeout=handshake_timeout or cfg.handshake_timeout,
        trusted_network=env.get(TRUSTED_ENV, "").strip() == "1",
    )


def _accept_unauthenticated(env: Mapping[str, str], backend: str, master: tuple[str, int]) -> None:
    """gloo and nccl only where the user said so (TANDEM_INSECURE_COMM=1, or a trusted
    network), and a warning every time: nothing else stops a local user writing their store."""
    where = f"{master[0]}:{master[1]}"
    if not any(env.get(k, "").strip() == "1" for k in (INSECURE_ENV, TRUSTED_ENV)):
        raise InsecureBackendError(
            f"TANDEM_COMM={backend}: torch.distributed's rendezvous store ({where}) and links are "
            "not authenticated: any user of this machine (any host that reaches it, beyond "
            "loopback) can write the store and join or read the group, and the cluster secret is "
            f"unused. Use TANDEM_COMM=ring or star (HMAC-authenticated), or set {INSECURE_ENV}=1 "
            "to run it anyway"
        )
    log.warning(
        "TANDEM_COMM=%s: the rendezvous store at %s is not authenticated and the cluster secret "
        "is unused; anyone who reaches it can join or read the group",
        backend,
        where,
    )


def facing_address(peer: str) -> str:
    """This host's address on the route toward `peer` (no packet is sent): where a ring rank
    listens when its RING_CONFIG names no listen_ip."""
    try:
        family = socket.getaddrinfo(peer, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
    except OSError as e:
        raise CommConfigError(
            f"cannot tell which of this host's addresses faces {peer} ({e}); set 'listen_ip' in "
            "RING_CONFIG"
        ) from None


def _master(cfg: RingConfig) -> tuple[str, int]:
    if cfg.master_port is None:
        raise CommConfigError(
            "master_port (RING_CONFIG) or MASTER_PORT is required for star, gloo and nccl"
        )
    ip = cfg.master_ip
    if ip is None:
        if cfg.rank != 0:
            raise CommConfigError(
                f"master_ip is required on rank {cfg.rank} (only rank 0 may leave it null)"
            )
        ip = "127.0.0.1"
    return ip, cfg.master_port
