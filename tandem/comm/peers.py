"""Forms the host-staged TCP ring from a peer list (every rank's ADDR:PORT), for the bench and the
lockstep probe."""

from __future__ import annotations

from tandem.comm.base import Communicator


def parse_peers(peers: list[str]) -> list[tuple[str, int]]:
    """`["10.77.0.1:29610", ...]` -> `[("10.77.0.1", 29610), ...]`; a bad entry is a ValueError."""
    out = []
    for p in peers:
        host, sep, port = p.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer {p!r}: expected ADDR:PORT")
        out.append((host, int(port)))
    return out


def connect_ring(rank: int, world: int, peers: list[str], secret: str) -> Communicator:
    """Rank `rank` listens on its own entry and dials the next rank's."""
    from tandem.comm.ring import RingCommunicator

    addrs = parse_peers(peers)
    if len(addrs) != world:
        raise ValueError(f"{len(addrs)} peers for a world of {world}")
    return RingCommunicator.create(
        rank, world, right=addrs[(rank + 1) % world], listen=addrs[rank],
        secret=secret.encode() if secret else None, cluster_id="tandem-bench",
    )  # fmt: skip
