"""A test seam: dial some links through a relay, so a fault test can blackhole them.

Heartbeat connections and a pipeline's stage links go to ports a process picks when it binds
(ephemeral) and tells its peer in-band or through a launcher, so no configuration can point them
at a relay standing between two ranks. With `TANDEM_TEST_RELAY` set, `connect` dials the relay
instead and first sends it one line naming the real destination ("HOST PORT\\n", the relay's side
of this is `tests/distributed/tcp_proxy.py`), then runs the handshake through it as usual: the
relay forwards both ways until the test cuts it. Child processes inherit the variable, so one
setting routes a link whichever process dials it.

    TANDEM_TEST_RELAY=127.0.0.1:PORT/A      every connection dialed by rank A or to rank A
    TANDEM_TEST_RELAY=127.0.0.1:PORT/A-B    every connection between ranks A and B, either way

Ranks are those of the dialer's identity and the rank it expects (a TP ring's ranks, a pipeline's
global ranks). Not a user setting: unset (always, outside tests) it changes nothing.
"""

from __future__ import annotations

import os
import socket

ENV = "TANDEM_TEST_RELAY"


class RelaySettingError(ValueError):
    """TANDEM_TEST_RELAY is not HOST:PORT/A or HOST:PORT/A-B."""


def relay_for(rank: int, peer: int | None) -> tuple[str, int] | None:
    """The relay a connection from `rank` to `peer` goes through, or None (dial directly)."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    try:
        addr, _, ranks = spec.rpartition("/")
        host, _, port = addr.rpartition(":")
        a, _, b = ranks.partition("-")
        relay, first, second = (host, int(port)), int(a), int(b) if b else None
    except ValueError as e:
        raise RelaySettingError(f"{ENV}={spec!r}: expected HOST:PORT/A or HOST:PORT/A-B") from e
    if not host:
        raise RelaySettingError(f"{ENV}={spec!r}: expected HOST:PORT/A or HOST:PORT/A-B")
    ends = {rank, peer}
    routed = first in ends if second is None else ends == {first, second}
    return relay if routed else None


def dial(addr: tuple[str, int], rank: int, peer: int | None, timeout: float) -> socket.socket:
    """A TCP connection to `addr` from `rank` (to `peer`): direct, or through the relay."""
    relay = relay_for(rank, peer)
    if relay is None:
        return socket.create_connection(addr, timeout=timeout)
    sock = socket.create_connection(relay, timeout=timeout)
    try:
        sock.sendall(f"{addr[0]} {addr[1]}\n".encode())
    except OSError:
        sock.close()
        raise
    return sock
