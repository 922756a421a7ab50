"""Forming the ring: rank r accepts its left neighbour (r-1) while it dials its right one (r+1),
both through the HMAC handshake; at N = 2 the two ranks then agree whether they share a host and
swap their small frames through shared memory (`transport.shm`); then, with a heartbeat timeout,
the ring's heartbeat connections form the same way (`form_heartbeats`, `transport.heartbeat`).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import numpy as np

from tandem.cluster.ring_config import check_heartbeat_timeout, check_timeout
from tandem.transport import shm as same_host
from tandem.transport.channel import Channel, UnexpectedFrameError
from tandem.transport.endpoints import Listener, connect
from tandem.transport.handshake import Identity
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr


def same_host_cap(small_max_bytes: int) -> int:
    """The same-host slot: the largest small frame (header with 8 dims + payload)."""
    return fr.FIXED_SIZE + 8 * fr.MAX_NDIM + small_max_bytes


def form_ring(
    rank: int,
    world_size: int,
    *,
    right: tuple[str, int],
    listen: tuple[str, int] | None,
    listener: Listener | None,
    secret: bytes | None,
    cluster_id: str,
    wire_dtype: str,
    model_fingerprint: str,
    handshake_timeout: float,
    op_timeout: float,
    small_max_bytes: int,
    max_frame_bytes: int,
    shared_memory: bool | None,
    heartbeat_timeout: float = 0.0,
) -> tuple[Channel, Channel, same_host.SamePair | None, list[Channel]]:
    """(left channel, right channel, the same-host pair or None, the heartbeat channels). Accepts
    the left neighbour while dialing the right one (with retry until `handshake_timeout`), then
    closes the listening socket; a refused dial fails the accept at once. At N = 2 shared memory
    is on when both ranks allow it (`shared_memory`, None: env TANDEM_SHM, default on) and share a
    host. With `heartbeat_timeout` > 0 the ring's heartbeat connections form next
    (`form_heartbeats`; [] with 0). On any failure every channel opened so far is closed before the
    error propagates."""
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"a ring needs world_size >= 2 and 0 <= rank < world_size, got {rank}/{world_size}"
        )
    check_timeout("op_timeout", op_timeout, "ring")
    check_timeout("handshake_timeout", handshake_timeout, "ring")
    check_heartbeat_timeout(heartbeat_timeout, "ring")
    wd.negotiable(wire_dtype)
    me = Identity(cluster_id, rank, world_size, wire_dtype, model_fingerprint, "ring")
    if listener is None:
        if listen is None:
            raise ValueError("RingCommunicator.create needs listen=(host, port) or listener=")
        listener = Listener(listen[0], listen[1], me, secret)
    else:
        listener.me, listener.secret = me, secret
    host = listener.host
    left, right_ch = _pair_up(
        me, right, listener, secret, handshake_timeout, op_timeout, max_frame_bytes
    )
    pair, beats = None, []
    try:
        if world_size == 2:
            pair = same_host.negotiate(
                rank, right_ch, left, same_host_cap(small_max_bytes),
                same_host.enabled_from_env() if shared_memory is None else shared_memory,
            )  # fmt: skip
        if heartbeat_timeout > 0:
            beats = form_heartbeats(me, left, right_ch, right[0], host, secret, handshake_timeout)
    except BaseException:
        if pair is not None:
            pair.close()
        left.close()
        right_ch.close()
        raise
    return left, right_ch, pair, beats


def _pair_up(
    me: Identity,
    right: tuple[str, int],
    listener: Listener,
    secret: bytes | None,
    handshake_timeout: float,
    op_timeout: float,
    max_frame_bytes: int,
) -> tuple[Channel, Channel]:
    """(left, right): accepts rank r-1 on `listener` while dialing rank r+1 at `right`; closes
    the listener. On failure nothing stays open."""
    rank, world_size = me.rank, me.world_size
    got: dict[str, Any] = {}

    def dial() -> None:
        try:
            got["right"] = connect(
                right[0], right[1], me, secret, expect_rank=(rank + 1) % world_size,
                handshake_timeout=handshake_timeout, op_timeout=op_timeout,
                max_frame_bytes=max_frame_bytes,
            )  # fmt: skip
        except BaseException as e:  # re-raised on the forming thread below
            got["error"] = e

    dialer = threading.Thread(target=dial, name=f"ring-dial-{rank}", daemon=True)
    dialer.start()
    try:
        left = listener.accept(
            {(rank - 1) % world_size},
            timeout=handshake_timeout,
            op_timeout=op_timeout,
            max_frame_bytes=max_frame_bytes,
            give_up=lambda: got.get("error"),  # a refused dial fails the ring at once
        )
    except BaseException:
        dialer.join()
        if "right" in got:
            got["right"].close()
        raise
    finally:
        listener.close()
    dialer.join()
    if "error" in got:
        left.close()
        raise got["error"]
    return left, got["right"]


def form_heartbeats(
    me: Identity,
    left: Channel,
    right: Channel,
    right_host: str,
    listen_host: str,
    secret: bytes | None,
    handshake_timeout: float,
) -> list[Channel]:
    """The ring's heartbeat connections [from the left neighbour, to the right one], formed the
    way the ring formed (the same handshake and secret, role "beat"): each rank listens on a
    fresh port of its ring address, tells its left neighbour that port in one P2P frame over the
    formed ring, and dials the port its right neighbour told it (`transport.heartbeat`)."""
    beat_me = replace(me, role="beat")
    listener = Listener(listen_host, 0, beat_me, secret)
    try:
        port = np.array([listener.port], dtype=np.int64)
        left.send_array(
            op=fr.P2P, seq=0, dtype_code=wd.INT64.code, shape=(1,), payload=port.tobytes()
        )
        header, got = right.recv_array(op=fr.P2P, seq=0, max_bytes=8)
        if header.dtype != wd.INT64.code or header.shape != (1,):
            raise UnexpectedFrameError(
                f"rank {me.rank}: expected rank {right.peer_rank}'s heartbeat port, got "
                f"{header.describe()}"
            )
        right_port = int(np.frombuffer(got, dtype=np.int64)[0])
    except BaseException:
        listener.close()
        raise
    beat_left, beat_right = _pair_up(
        beat_me, (right_host, right_port), listener, secret, handshake_timeout,
        handshake_timeout, 64,
    )  # fmt: skip
    return [beat_left, beat_right]
