"""The RING_CONFIG file: one JSON object per rank naming where it listens and whom it dials.

    { "master_ip": "192.168.77.1" | null, "master_port": 9002,
      "port": 9001, "right_ip": "192.168.77.1", "right_port": 9000,
      "rank": 1, "world_size": 2,
      "secret": "...",                         optional (else TANDEM_SECRET)
      "listen_ip": "192.168.77.2",             optional bind address (default: see bind_ip)
      "cluster_id": "lab", "wire_dtype": "float32",
      "handshake_timeout": 120, "op_timeout": 60,
      "heartbeat_timeout": 3 }                 optional (0: no heartbeats)

Rank r binds `port` and dials its right neighbour at right_ip:right_port (the paper's format).
`master_ip`/`master_port` name rank 0's rendezvous (the star root, torch.distributed's master);
master_ip is null on rank 0 itself. Pure data: parsing only, every error naming its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem import boundedjson

RING_CONFIG_MAX_BYTES = 64 * 1024


class RingConfigError(ValueError):
    """A RING_CONFIG that cannot be used; the message names the file and the field."""


class TimeoutValueError(RingConfigError):
    """A timeout that is not a finite number of seconds above zero (0 would mean "fail at once",
    not "never"; it is refused rather than read as the default)."""


DEFAULT_HANDSHAKE_TIMEOUT_S = 120.0
DEFAULT_OP_TIMEOUT_S = 60.0
KEEPALIVE_MAX_S = 5.0
# a peer silent this long is lost (`transport.heartbeat`); serve, launch, cluster join, worker
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0


def check_timeout(name: str, value: object, where: str = "timeout") -> float:
    """`value` as float seconds, or TimeoutValueError naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise TimeoutValueError(
            f"{where}: {name} must be a finite number of seconds above 0, got {value!r}"
        )
    return float(value)


def check_heartbeat_timeout(value: object, where: str = "timeout") -> float:
    """A heartbeat timeout as float seconds: 0 (heartbeats off) or a finite number above 0;
    otherwise TimeoutValueError."""
    if not isinstance(value, bool) and isinstance(value, int | float) and value == 0:
        return 0.0
    return check_timeout("heartbeat_timeout", value, where)


def keepalive_interval(op_timeout: float) -> float:
    """How often an idle group pings its peers: a quarter of the op timeout, so that a peer
    waiting for the next frame always hears one well inside its timeout, and at most
    KEEPALIVE_MAX_S. A peer that stops answering is seen within op_timeout + 2 intervals."""
    return min(KEEPALIVE_MAX_S, check_timeout("op_timeout", op_timeout) / 4)


@dataclass(frozen=True)
class RingConfig:
    rank: int
    world_size: int
    port: int
    right_ip: str
    right_port: int
    master_ip: str | None = None
    master_port: int | None = None
    secret: str | None = None
    listen_ip: str | None = None
    cluster_id: str = "tandem"
    wire_dtype: str = "float32"
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    op_timeout: float = DEFAULT_OP_TIMEOUT_S
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S

    def bind_ip(self, has_secret: bool) -> str | None:
        """Where to listen: `listen_ip` if given; loopback for a ring that stays on this host or
        has no secret (an unsecured ring never leaves the host); None for a secured multi-host
        ring, whose caller listens on this host's address toward `right_ip` (never on every
        interface unless `listen_ip` is "0.0.0.0")."""
        if self.listen_ip:
            return self.listen_ip
        loop = self.right_ip in ("127.0.0.1", "localhost", "::1")
        return None if has_secret and not loop else "127.0.0.1"


def epoch_cluster_id(base: str, epoch: int) -> str:
    """The cluster id a ring claims in its handshake in `epoch` (`base` in epoch 0): a group
    re-formed after a loss claims its epoch, so a rank (or a frame) of an earlier epoch is refused
    at the handshake though it holds the same secret."""
    if epoch < 0:
        raise RingConfigError(f"an epoch is >= 0, got {epoch}")
    return base if epoch == 0 else f"{base}/epoch-{epoch}"


def secret_bytes(text: str | None) -> bytes | None:
    """The cluster key from its text form (the `secret` field or TANDEM_SECRET): hex digits when
    the text is valid hex (what `tandem` generates), else its UTF-8 bytes; None when empty."""
    if not text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()


def _need(d: dict, key: str, kind: type, where: str, *, optional: bool = False) -> Any:
    if key not in d or d[key] is None:
        if optional:
            return None
        raise RingConfigError(f"{where}: field {key!r} is required")
    v = d[key]
    if kind is float and type(v) is int:
        v = float(v)
    if type(v) is not kind:
        raise RingConfigError(f"{where}: field {key!r} must be {kind.__name__}, got {v!r}")
    return v


def _port(d: dict, key: str, where: str, *, optional: bool = False) -> int | None:
    v = _need(d, key, int, where, optional=optional)
    if v is not None and not 1 <= v <= 65535:
        raise RingConfigError(f"{where}: field {key!r} must be a TCP port 1..65535, got {v}")
    return v


def _timeout(d: dict, key: str, default: float, where: str) -> float:
    v = _need(d, key, float, where, optional=True)
    return default if v is None else check_timeout(f"field {key!r}", v, where)


def _heartbeat(d: dict, where: str) -> float:
    v = _need(d, "heartbeat_timeout", float, where, optional=True)
    if v is None:
        return DEFAULT_HEARTBEAT_TIMEOUT_S
    return check_heartbeat_timeout(v, f"{where}: field 'heartbeat_timeout'")


def parse_ring_config(d: object, where: str = "RING_CONFIG") -> RingConfig:
    """A checked RingConfig from the decoded JSON object `d`."""
    if not isinstance(d, dict):
        raise RingConfigError(f"{where}: must be a JSON object, got {type(d).__name__}")
    unknown = set(d) - {f for f in RingConfig.__dataclass_fields__}
    if unknown:
        raise RingConfigError(f"{where}: unknown field(s) {sorted(unknown)}")
    world = _need(d, "world_size", int, where)
    if world < 1:
        raise RingConfigError(f"{where}: field 'world_size' must be >= 1, got {world}")
    rank = _need(d, "rank", int, where)
    if not 0 <= rank < world:
        raise RingConfigError(f"{where}: field 'rank' must be in [0, {world}), got {rank}")
    cfg = RingConfig(
        rank=rank,
        world_size=world,
        port=_port(d, "port", where),
        right_ip=_need(d, "right_ip", str, where),
        right_port=_port(d, "right_port", where),
        master_ip=_need(d, "master_ip", str, where, optional=True),
        master_port=_port(d, "master_port", where, optional=True),
        secret=_need(d, "secret", str, where, optional=True),
        listen_ip=_need(d, "listen_ip", str, where, optional=True),
        cluster_id=_need(d, "cluster_id", str, where, optional=True) or "tandem",
        wire_dtype=_need(d, "wire_dtype", str, where, optional=True) or "float32",
        handshake_timeout=_timeout(d, "handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT_S, where),
        op_timeout=_timeout(d, "op_timeout", DEFAULT_OP_TIMEOUT_S, where),
        heartbeat_timeout=_heartbeat(d, where),
    )
    if cfg.wire_dtype not in ("float32", "bfloat16", "float16"):
        raise RingConfigError(
            f"{where}: field 'wire_dtype' must be float32, bfloat16 or float16, got {cfg.wire_dtype!r}"
        )
    return cfg


def load_ring_config(path: str | Path) -> RingConfig:
    """Read and check the RING_CONFIG file at `path`."""
    where = f"RING_CONFIG {path}"
    try:
        raw = Path(path).read_text()
    except OSError as e:
        raise RingConfigError(f"{where}: cannot read ({e.strerror})") from None
    try:
        d = boundedjson.loads(raw, max_bytes=RING_CONFIG_MAX_BYTES, max_depth=4)
    except boundedjson.BoundedJSONError as e:
        raise RingConfigError(f"{where}: {e}") from None
    return parse_ring_config(d, where)
