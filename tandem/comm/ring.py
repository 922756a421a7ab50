"""The host-staged TCP ring: a Communicator any device can join (cuda, rocm, mps, xpu, cpu).

Rank r listens for its left neighbour (r-1) and dials its right neighbour (r+1), both through the
HMAC handshake (`ring_form`); for N = 2 the two ranks hold two connections, one per direction,
and when they share a host they swap their small frames through shared memory instead
(`transport.shm`: the same frames, the same checks). Every tensor crosses to the host through
`staging` (its `host_tensor`), travels in the negotiated wire dtype (float32 by default), is
reduced in float32, and returns on the caller's device in the caller's dtype.

`RingCommunicator` is the face; the work is done by one of three roads, each in its own file and
each chosen by an explicit eligibility check (`all_reduce_sum`):
- `ring_shm.SameHostRoad`, N = 2 on one host, a float32 tensor under the small cut-over: the
  decode all-reduce through a shared-memory lane (and, for the general road, the small frames
  of RANK_ORDER all-reduces and broadcasts);
- `ring_pair.TcpPair`, N = 2 over TCP, the float32 wire, a small float32 CPU tensor: one frame
  each way;
- `ring_tcp.TcpRing`, everything else, every op: RANK_ORDER for small tensors, the chunked RING
  (reduce-scatter + all-gather) above (`algorithms`).
Every road ends with bit-identical values on every rank equal to `reference` for the same
algorithm, and all three speak the same frames (`ring_link`), so ranks on different roads (say, a
bfloat16 rank beside a float32 one) meet. Frames carry the op, sequence number, step and an op
fingerprint (op, dtype, shape): ranks that call different ops or shapes fail with OpDesyncError
at the first frame, before any payload is read.

Each link also carries heartbeats on its own connection (`transport.heartbeat`, formed by
`ring_form.form_heartbeats`): a neighbour silent for `heartbeat_timeout` (default 3 s, 0: none)
breaks the ring at once, and the op waiting on it raises PeerLostError naming that rank.

Programmatic construction (spawned workers, tests):

    comm = RingCommunicator.create(
        rank, world_size, right=("10.0.0.2", 29501), listen=("0.0.0.0", 29500),
        secret=b"...", cluster_id="c1", wire_dtype="float32", model_fingerprint="sha256:...",
        handshake_timeout=120.0, op_timeout=60.0)

`listen=` may be replaced by `listener=` (a bound `transport.endpoints.Listener`, e.g. on port 0
so the port can be reported before the ring forms). Failures raise CommError subclasses (base)
or transport errors (PeerClosedError, PeerTimeoutError, AuthError, ...); after a failure mid-op
the communicator is broken and refuses further ops with CommClosedError.
"""

from __future__ import annotations

import torch

from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S, check_timeout
from tandem.comm import algorithms as alg
from tandem.comm.ring_form import form_ring, same_host_cap
from tandem.comm.ring_link import RingLink
from tandem.comm.ring_pair import TcpPair
from tandem.comm.ring_shm import SameHostRoad
from tandem.comm.ring_tcp import TcpRing
from tandem.transport import shm as same_host
from tandem.transport.channel import Channel
from tandem.transport.endpoints import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_OP_TIMEOUT_S,
    Listener,
)
from tandem.transport.heartbeat import Heartbeat
from tandem.wire import dtypes as wd

__all__ = ["RingCommunicator", "same_host_cap"]


class RingCommunicator:
    """Rank `rank` of a `world_size` ring over two authenticated channels (left, right)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        left: Channel,
        right: Channel,
        *,
        wire_dtype: str = "float32",
        small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
        same_host_pair: same_host.SamePair | None = None,
        heartbeats: list[Channel] | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        link = self._link = RingLink(rank, world_size, left, right, wire_dtype, small_max_bytes)
        # a neighbour silent for heartbeat_timeout breaks the ring at once (`transport.heartbeat`)
        self._heartbeat = (
            Heartbeat(rank, heartbeats, heartbeat_timeout, link.lose) if heartbeats else None
        )
        pair_f32 = world_size == 2 and link.wire.code == wd.FLOAT32.code
        # N = 2 on one host: small all-reduces and broadcasts swap through shared memory
        self._shm = (
            SameHostRoad(link, same_host_pair, small_max_bytes // 4 if pair_f32 else 0)
            if same_host_pair is not None and world_size == 2
            else None
        )
        # N = 2 over TCP, the float32 wire: the one-exchange all-reduce (same host: the lanes)
        self._pair = TcpPair(link) if pair_f32 and self._shm is None else None
        self._tcp = TcpRing(link, self._shm)

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        right: tuple[str, int],
        listen: tuple[str, int] | None = None,
        listener: Listener | None = None,
        secret: bytes | None = None,
        cluster_id: str = "tandem",
        wire_dtype: str = "float32",
        model_fingerprint: str = "",
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        op_timeout: float = DEFAULT_OP_TIMEOUT_S,
        small_max_bytes: int = alg.DEFAULT_SMALL_MAX_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        shared_memory: bool | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> RingCommunicator:
        """Form the ring (`ring_form.form_ring`): accept the left neighbour while dialing the
        right one (with retry until `handshake_timeout`), then close the listening socket. At
        N = 2 the ranks then agree on same-host shared memory for small all-reduces
        (`transport.shm`): on when both ranks allow it (`shared_memory`, None: env TANDEM_SHM,
        default on) and share a host. With `heartbeat_timeout` > 0 (0: none) each link also gets
        a heartbeat connection, and a neighbour silent that long fails the ring's waiting or next
        op at once with PeerLostError (`transport.heartbeat`)."""
        left, right_channel, pair, beats = form_ring(
            rank, world_size, right=right, listen=listen, listener=listener, secret=secret,
            cluster_id=cluster_id, wire_dtype=wire_dtype, model_fingerprint=model_fingerprint,
            handshake_timeout=handshake_timeout, op_timeout=op_timeout,
            small_max_bytes=small_max_bytes, max_frame_bytes=max_frame_bytes,
            shared_memory=shared_memory, heartbeat_timeout=heartbeat_timeout,
        )  # fmt: skip
        return cls(
            rank,
            world_size,
            left,
            right_channel,
            wire_dtype=wire_dtype,
            small_max_bytes=small_max_bytes,
            same_host_pair=pair,
            heartbeats=beats,
            heartbeat_timeout=heartbeat_timeout,
        )

    def set_op_timeout(self, seconds: float) -> float:
        """Sets the no-progress bound of every later op on both links (the same-host road waits
        on the left one); returns the previous bound. For phases that wait on a peer's work
        rather than a step, e.g. a group's setup waiting for the slowest rank to load."""
        check_timeout("op_timeout", seconds, "ring")
        old = self._link.left.ts.timeout
        self._link.left.ts.timeout = self._link.right.ts.timeout = seconds
        return old

    def lost(self) -> str | None:
        """Why the heartbeat declared a neighbour lost (naming its rank), or None."""
        lost = self._link.lost
        return None if lost is None else str(lost)

    @property
    def same_host(self) -> bool:
        """True when this N = 2 ring swaps its small all-reduces through shared memory."""
        return self._shm is not None

    @property
    def rank(self) -> int:
        return self._link.rank

    @property
    def world_size(self) -> int:
        return self._link.size

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        shm = self._shm
        if shm is not None:
            lane = shm.lane_for(t)
            if lane is not None:
                return shm.all_reduce(t, lane)
        if self._pair is not None and self._pair.takes(t):
            return self._pair.all_reduce(t)
        return self._tcp.all_reduce_sum(t)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._tcp.reduce_scatter(t, dim)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._tcp.all_gather(t, dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._tcp.broadcast(t, src)

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._tcp.all_to_all(parts)

    def barrier(self) -> None:
        self._tcp.barrier()

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        self._link.close()
        if self._shm is not None:
            self._shm.close()
