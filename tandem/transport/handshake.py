"""Mutual HMAC-SHA256 challenge-response: both ends prove the cluster secret and agree on terms.

    connector -> acceptor   HELLO   {claims_c, nonce_c}
    acceptor  -> connector  HELLO   {claims_a, nonce_a, mac_a = HMAC(k, "acceptor" | hello_c | claims_a | nonce_a)}
    connector -> acceptor   AUTH    {mac_c = HMAC(k, "connector" | hello_c | hello_a)}   (or a refusal)
    acceptor  -> connector  VERDICT {ok | refusal with the reason}

The claims (cluster id, rank, world size, protocol version, wire dtype, model fingerprint, the
channel's role) sit inside the MAC'd transcript, so the secret binds them; fresh nonces on both
sides defeat replay. A mismatch is refused with a message naming both sides' values. Without a
secret the MAC key is empty and only loopback peers are accepted (checked by the endpoints).
Handshake messages are small JSON objects (at most HELLO_MAX_BYTES, nested at most
HELLO_MAX_DEPTH levels, both checked before the parser runs) parsed into checked fields.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import asdict, dataclass, fields

from tandem import boundedjson
from tandem.transport.socketio import TimedSocket, TransportError
from tandem.wire import dtypes
from tandem.wire import frame as fr

HELLO_MAX_BYTES = 4096
HELLO_MAX_DEPTH = 4  # {"claims": {...}, ...}: nothing deeper is ever sent


class HandshakeError(TransportError):
    """The handshake could not complete: malformed messages or a refusal."""


class AuthError(HandshakeError):
    """The peer could not prove the cluster secret (or we could not prove it to the peer)."""


class ClaimMismatchError(HandshakeError):
    """Both ends are authentic but disagree on cluster id, world size, wire dtype, model, role or rank."""


@dataclass(frozen=True)
class Identity:
    """What a rank claims about itself and the cluster it belongs to (all bound by the secret)."""

    cluster_id: str
    rank: int
    world_size: int
    wire_dtype: str = "float32"
    model_fingerprint: str = ""
    role: str = "ring"
    protocol_version: int = fr.PROTOCOL_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: object) -> Identity:
        if not isinstance(d, dict):
            raise HandshakeError("malformed hello: claims are not an object")
        kw = {}
        for f in fields(cls):
            v = d.get(f.name)
            want = int if f.type in ("int", int) else str
            if type(v) is not want:
                raise HandshakeError(f"malformed hello: field {f.name!r} is {v!r}")
            kw[f.name] = v
        return cls(**kw)


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def _send_msg(ts: TimedSocket, kind: int, body: dict) -> bytes:
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    head = fr.encode_header(kind, fr.HANDSHAKE, dtypes.UINT8.code, 0, 0, (len(raw),))
    ts.send_all([head, raw])
    return raw


def _recv_msg(ts: TimedSocket, kind: int) -> tuple[dict, bytes]:
    header, ndim = fr.decode_fixed(ts.recv_exact(fr.FIXED_SIZE))
    header = fr.decode_shape(header, ts.recv_exact(8 * ndim))
    n = fr.check_length(header, HELLO_MAX_BYTES)
    if header.op != fr.HANDSHAKE or header.kind != kind or header.dtype != dtypes.UINT8.code:
        raise HandshakeError(f"unexpected frame during handshake: {header.describe()}")
    raw = bytes(ts.recv_exact(n))
    try:
        body = boundedjson.loads(raw, max_bytes=HELLO_MAX_BYTES, max_depth=HELLO_MAX_DEPTH)
    except boundedjson.BoundedJSONError as e:
        raise HandshakeError(f"malformed handshake message: {e}") from None
    if not isinstance(body, dict):
        raise HandshakeError("malformed handshake message: not an object")
    return body, raw


def _hexfield(body: dict, name: str, nbytes: int) -> bytes:
    v = body.get(name)
    try:
        b = bytes.fromhex(v) if isinstance(v, str) else b""
    except ValueError:
        b = b""
    if len(b) != nbytes:
        raise HandshakeError(f"malformed handshake message: bad {name}")
    return b


def compare_claims(mine: Identity, theirs: Identity, expect_ranks: set[int] | None) -> None:
    """Refuse a peer whose terms differ from ours, naming both values."""
    for name in (
        "protocol_version",
        "cluster_id",
        "world_size",
        "wire_dtype",
        "model_fingerprint",
        "role",
    ):
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            raise ClaimMismatchError(
                f"{name.replace('_', ' ')} mismatch: this rank (rank {mine.rank}) has {a!r}, "
                f"peer (rank {theirs.rank}) has {b!r}"
            )
    if expect_ranks is not None and theirs.rank not in expect_ranks:
        raise ClaimMismatchError(
            f"rank mismatch: this rank (rank {mine.rank}) expects a peer of rank "
            f"{sorted(expect_ranks)}, peer claims rank {theirs.rank}"
        )
    if not 0 <= theirs.rank < theirs.world_size or theirs.rank == mine.rank:
        raise ClaimMismatchError(
            f"rank mismatch: peer claims rank {theirs.rank} of {theirs.world_size} and this is "
            f"rank {mine.rank}"
        )


def connector_handshake(
    ts: TimedSocket, me: Identity, secret: bytes | None, expect_ranks: set[int] | None
) -> Identity:
    """Run the connecting side; the peer's verified identity, or a HandshakeError subclass."""
    key = secret or b""
    nonce = os.urandom(32)
    hello_c = _send_msg(ts, fr.HELLO, {"claims": me.to_json(), "nonce": nonce.hex()})
    body, hello_a = _recv_msg(ts, fr.HELLO)
    if body.get("refused"):
        raise ClaimMismatchError(f"peer refused the connection: {body['refused']}")
    theirs = Identity.from_json(body.get("claims"))
    nonce_a = _hexfield(body, "nonce", 32)
    claims_a = json.dumps(body["claims"], sort_keys=True, separators=(",", ":")).encode()
    expect = _mac(key, b"acceptor", hello_c, claims_a, nonce_a)
    if not hmac.compare_digest(expect, _hexfield(body, "mac", 32)):
        _send_msg(ts, fr.AUTH, {"refused": "acceptor failed to prove the cluster secret"})
        raise AuthError(
            f"peer (claims rank {theirs.rank}) could not prove the cluster secret: "
            f"wrong or missing secret on one side"
        )
    try:
        compare_claims(me, theirs, expect_ranks)
    except ClaimMismatchError as e:
        _send_msg(ts, fr.AUTH, {"refused": str(e)})
        raise
    _send_msg(ts, fr.AUTH, {"mac": _mac(key, b"connector", hello_c, hello_a).hex()})
    verdict, _ = _recv_msg(ts, fr.VERDICT)
    if verdict.get("ok") is not True:
        reason = str(verdict.get("refused", "no reason given"))[:500]
        err = AuthError if "secret" in reason else ClaimMismatchError
        raise err(f"peer refused the connection: {reason}")
    return theirs


def acceptor_handshake(
    ts: TimedSocket, me: Identity, secret: bytes | None, expect_ranks: set[int] | None
) -> Identity:
    """Run the accepting side; the peer's verified identity, or a HandshakeError subclass."""
    key = secret or b""
    body, hello_c = _recv_msg(ts, fr.HELLO)
    theirs = Identity.from_json(body.get("claims"))
    nonce_c = _hexfield(body, "nonce", 32)
    del nonce_c  # bound through hello_c, which both MACs cover
    nonce_a = os.urandom(32)
    claims_a = json.dumps(me.to_json(), sort_keys=True, separators=(",", ":")).encode()
    mac_a = _mac(key, b"acceptor", hello_c, claims_a, nonce_a)
    hello_a = _send_msg(
        ts, fr.HELLO, {"claims": me.to_json(), "nonce": nonce_a.hex(), "mac": mac_a.hex()}
    )
    auth, _ = _recv_msg(ts, fr.AUTH)
    if auth.get("refused"):
        reason = str(auth["refused"])[:500]
        err = AuthError if "secret" in reason else ClaimMismatchError
        raise err(f"peer refused the connection: {reason}")
    if not hmac.compare_digest(
        _mac(key, b"connector", hello_c, hello_a), _hexfield(auth, "mac", 32)
    ):
        _send_msg(ts, fr.VERDICT, {"refused": "connector failed to prove the cluster secret"})
        raise AuthError(
            f"peer (claims rank {theirs.rank}) could not prove the cluster secret: "
            f"wrong or missing secret on one side"
        )
    try:
        compare_claims(me, theirs, expect_ranks)
    except ClaimMismatchError as e:
        _send_msg(ts, fr.VERDICT, {"refused": str(e)})
        raise
    _send_msg(ts, fr.VERDICT, {"ok": True})
    return theirs
