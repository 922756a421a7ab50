"""Join tokens: a cluster's topology and a fresh secret in one copy-pasteable (or scannable) string.

A token is two fixed-width base58 numbers written back to back (one word, all base58 characters):

    header     9 chars   magic b"TDM" | version (1 byte) | body length L (2 bytes), big-endian
    payload    W(L + 4)  body (L bytes of UTF-8 JSON: cluster_id, secret, hosts, base_port, tp, pp)
                         | checksum = sha256(header bytes | body)[:4]

W(n) = ceil(8n / log2(58)) characters, left-padded with "1" (base58's zero digit). Fixed widths make
each failure distinguishable: a wrong magic is "foreign", another version names both versions, fewer
characters than W(L + 4) is "truncated", and any changed character fails the checksum ("corrupt").

Rank r of a token listens on `base_port + r` on `hosts[r]` (so several ranks can share one host, e.g.
loopback); the head (rank 0) also owns `base_port + N` (the master port) and `base_port + N + 1`
(the status port), where N = len(hosts) = tp * pp.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import secrets
import struct
from dataclasses import dataclass

import base58

from tandem import boundedjson

MAGIC = b"TDM"
TOKEN_VERSION = 1
_HEADER = struct.Struct(">3sBH")  # magic, version, body length
_CHECKSUM_LEN = 4
MAX_WORLD = 1024


class JoinTokenError(ValueError):
    """A join token that cannot be used; the message says why and what to do."""


class TokenMalformed(JoinTokenError):
    """Not base58 text at all (a stray character, or something that is not a token)."""


class TokenTruncated(JoinTokenError):
    """Shorter than its own header says: part of the token was lost in copying."""


class TokenForeign(JoinTokenError):
    """Not a tandem join token."""


class TokenVersionError(JoinTokenError):
    """A tandem token of a format version this build does not read."""


class TokenCorrupt(JoinTokenError):
    """The checksum does not match, or the body is not a valid topology."""


@dataclass(frozen=True)
class ClusterTopology:
    """Who is in the cluster and how the model is split: world size N = tp * pp = len(hosts).

    Rank r runs on `hosts[r]`; ranks are ordered pipeline stage major: stage s holds ranks
    [s * tp, (s + 1) * tp), which form that stage's tensor-parallel group.
    """

    hosts: tuple[str, ...]
    base_port: int
    tp: int
    pp: int
    cluster_id: str
    secret: str  # hex of 32 random bytes: the HMAC key of every handshake in this cluster
    model: str | None = None  # optional model fingerprint or name the operator pinned

    def __post_init__(self) -> None:
        n = len(self.hosts)
        if n < 1 or n > MAX_WORLD:
            raise TokenCorrupt(f"a cluster needs 1..{MAX_WORLD} hosts, got {n}")
        if self.tp < 1 or self.pp < 1 or self.tp * self.pp != n:
            raise TokenCorrupt(f"layout tp={self.tp} x pp={self.pp} does not cover {n} hosts")
        if not 1 <= self.base_port <= 65535 - n - 1:
            raise TokenCorrupt(f"base_port {self.base_port} leaves no room for {n} ranks")
        if any(not h or len(h) > 253 for h in self.hosts):
            raise TokenCorrupt("a host name is empty or longer than 253 characters")

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def master_port(self) -> int:
        return self.base_port + self.world_size

    @property
    def status_port(self) -> int:
        return self.base_port + self.world_size + 1

    def port_of(self, rank: int) -> int:
        self._check_rank(rank)
        return self.base_port + rank

    def ring_config(self, rank: int) -> dict:
        """The paper's RING_CONFIG for `rank`: bind `port`, dial the right neighbour, know the head."""
        self._check_rank(rank)
        right = (rank + 1) % self.world_size
        cfg = {
            "master_ip": None if rank == 0 else self.hosts[0],
            "master_port": self.master_port,
            "port": self.port_of(rank),
            "right_ip": self.hosts[right],
            "right_port": self.port_of(right),
            "rank": rank,
            "world_size": self.world_size,
            "secret": self.secret,
            "cluster_id": self.cluster_id,
        }
        if _is_ip(self.hosts[rank]):  # listen there alone (a name may resolve to 127.0.1.1)
            cfg["listen_ip"] = self.hosts[rank]
        return cfg

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this cluster of {self.world_size}")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def new_topology(
    hosts: list[str], tp: int, pp: int, base_port: int = 29500, model: str | None = None
) -> ClusterTopology:
    """A topology with a fresh cluster id and a fresh 256-bit secret."""
    return ClusterTopology(
        hosts=tuple(hosts),
        base_port=base_port,
        tp=tp,
        pp=pp,
        cluster_id=secrets.token_hex(8),
        secret=secrets.token_hex(32),
        model=model,
    )


def parse_layout(layout: str | None, n_hosts: int) -> tuple[int, int]:
    """`tp` (default: every host in one TP group), `pp`, or `tpAxppB` / `tp=A,pp=B` -> (tp, pp)."""
    text = (layout or "tp").strip().lower().replace(" ", "")
    if text == "tp":
        return n_hosts, 1
    if text == "pp":
        return 1, n_hosts
    parts = text.replace(",", "x").split("x")
    found: dict[str, int] = {}
    for part in parts:
        key = part[:2]
        value = part[2:].lstrip("=")
        if key not in ("tp", "pp") or not value.isdigit() or key in found:
            raise ValueError(f"layout {layout!r}: expected 'tp', 'pp' or e.g. 'tp2xpp2'")
        found[key] = int(value)
    tp, pp = found.get("tp", 1), found.get("pp", 1)
    if tp * pp != n_hosts:
        raise ValueError(f"layout {layout!r} needs {tp * pp} hosts, got {n_hosts}")
    return tp, pp


def _width(n_bytes: int) -> int:
    """Base58 digits that hold any n-byte number: ceil(8n / log2(58))."""
    return math.ceil(n_bytes * 8 / math.log2(58))


def _b58_fixed(data: bytes) -> str:
    return base58.b58encode_int(int.from_bytes(data, "big")).decode().rjust(_width(len(data)), "1")


def _b58_fixed_decode(text: str, n_bytes: int) -> bytes:
    value = base58.b58decode_int(text)
    if value >= 1 << (8 * n_bytes):
        raise TokenCorrupt("the join token is corrupt (a number overflows its field)")
    return value.to_bytes(n_bytes, "big")


def encode_token(topo: ClusterTopology) -> str:
    """The base58 join token of `topo` (see the module docstring for the byte layout)."""
    body = json.dumps(
        {
            "cluster_id": topo.cluster_id,
            "secret": topo.secret,
            "hosts": list(topo.hosts),
            "base_port": topo.base_port,
            "tp": topo.tp,
            "pp": topo.pp,
            "model": topo.model,
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()
    if len(body) > 0xFFFF:
        raise ValueError("topology too large for a join token")
    header = _HEADER.pack(MAGIC, TOKEN_VERSION, len(body))
    checksum = hashlib.sha256(header + body).digest()[:_CHECKSUM_LEN]
    return _b58_fixed(header) + _b58_fixed(body + checksum)


def decode_token(token: str) -> ClusterTopology:
    """Parses a join token; raises a `JoinTokenError` subclass saying exactly what is wrong."""
    text = token.strip()
    if not text:
        raise TokenMalformed("the join token is empty")
    alphabet = base58.alphabet.decode()
    bad = sorted({c for c in text if c not in alphabet})
    if bad:
        raise TokenMalformed(
            f"not a join token: characters {''.join(bad)!r} are not base58 (copy the whole token)"
        )
    hw = _width(_HEADER.size)
    if len(text) < hw:
        raise TokenTruncated("the join token is truncated: copy the whole token")
    try:
        header = _b58_fixed_decode(text[:hw], _HEADER.size)
    except TokenCorrupt as e:
        raise TokenForeign("this is not a tandem join token") from e
    magic, version, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise TokenForeign("this is not a tandem join token (wrong magic)")
    if version != TOKEN_VERSION:
        raise TokenVersionError(
            f"join token format v{version}, this tandem reads v{TOKEN_VERSION}: "
            "run the same tandem version on every node"
        )
    pw = _width(length + _CHECKSUM_LEN)
    if len(text) - hw < pw:
        raise TokenTruncated(
            f"the join token is truncated ({len(text)} of {hw + pw} characters): "
            "copy the whole token"
        )
    if len(text) - hw > pw:
        raise TokenCorrupt("the join token has extra characters: it is corrupt")
    payload = _b58_fixed_decode(text[hw:], length + _CHECKSUM_LEN)
    body, checksum = payload[:length], payload[length:]
    if hashlib.sha256(header + body).digest()[:_CHECKSUM_LEN] != checksum:
        raise TokenCorrupt("the join token's checksum does not match: it was mistyped or damaged")
    try:
        d = boundedjson.loads(body, max_bytes=0xFFFF, max_depth=4)
        return ClusterTopology(
            hosts=tuple(str(h) for h in d["hosts"]),
            base_port=int(d["base_port"]),
            tp=int(d["tp"]),
            pp=int(d["pp"]),
            cluster_id=str(d["cluster_id"]),
            secret=str(d["secret"]),
            model=d.get("model"),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        if isinstance(e, JoinTokenError):
            raise
        raise TokenCorrupt(f"the join token's topology is invalid: {e}") from e


def token_qr(token: str) -> str:
    """The token as a QR code drawn with Unicode half blocks, for a terminal (scan to join)."""
    import io

    import qrcode

    qr = qrcode.QRCode(error_correction=qrcode.constants.ERROR_CORRECT_L, border=2)
    qr.add_data(token)
    qr.make(fit=True)
    out = io.StringIO()
    qr.print_ascii(out=out, invert=True)
    return out.getvalue()
