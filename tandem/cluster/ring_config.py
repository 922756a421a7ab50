"""The RING_CONFIG file: one JSON object per rank naming where it listens and whom it dials.

    { "master_ip": "192.168.77.1" | null, "master_port": 9002,
      "port": 9001, "right_ip": "192.168.77.1", "right_port": 9000,
      "rank": 1, "world_size": 2,
      "secret": "...",                         optional (else TANDEM_SECRET)
      "listen_ip": "0.0.0.0",                  optional bind address (default: see below)
      "cluster_id": "lab", "wire_dtype": "float32",
      "handshake_timeout": 120, "op_timeout": 60 }   optional

Rank r binds `port` and dials its right neighbour at right_ip:right_port (the paper's format).
`master_ip`/`master_port` name rank 0's rendezvous (the star root, torch.distributed's master);
master_ip is null on rank 0 itself. Pure data: parsing only, every error naming its field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem import boundedjson

RING_CONFIG_MAX_BYTES = 64 * 1024


class RingConfigError(ValueError):
    """A RING_CONFIG that cannot be used; the message names the file and the field."""


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
    handshake_timeout: float = 120.0
    op_timeout: float = 60.0

    def bind_ip(self, has_secret: bool) -> str:
        """Where to listen: `listen_ip` if given; all interfaces for a secured multi-host ring;
        loopback otherwise (an unsecured ring never leaves the host)."""
        if self.listen_ip:
            return self.listen_ip
        loop = self.right_ip in ("127.0.0.1", "localhost", "::1")
        return "0.0.0.0" if has_secret and not loop else "127.0.0.1"


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
        handshake_timeout=_need(d, "handshake_timeout", float, where, optional=True) or 120.0,
        op_timeout=_need(d, "op_timeout", float, where, optional=True) or 60.0,
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
