"""Forming the ring: rank r accepts its left neighbour (r-1) while it dials its right one (r+1),
both through the HMAC handshake; at N = 2 the two ranks then agree whether they share a host and
swap their small frames through shared memory (`transport.shm`).
"""

from __future__ import annotations

import threading
from typing import Any

from tandem.cluster.ring_config import check_timeout
from tandem.transport import shm as same_host
from tandem.transport.channel import Channel
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
) -> tuple[Channel, Channel, same_host.SamePair | None]:
    """(left channel, right channel, the same-host pair or None). Accepts the left neighbour while
    dialing the right one (with retry until `handshake_timeout`), then closes the listening
    socket; a refused dial fails the accept at once. At N = 2 shared memory is on when both ranks
    allow it (`shared_memory`, None: env TANDEM_SHM, default on) and share a host. On any failure
    every channel opened so far is closed before the error propagates."""
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"a ring needs world_size >= 2 and 0 <= rank < world_size, got {rank}/{world_size}"
        )
    check_timeout("op_timeout", op_timeout, "ring")
    check_timeout("handshake_timeout", handshake_timeout, "ring")
    wd.negotiable(wire_dtype)
    me = Identity(cluster_id, rank, world_size, wire_dtype, model_fingerprint, "ring")
    if listener is None:
        if listen is None:
            raise ValueError("RingCommunicator.create needs listen=(host, port) or listener=")
        listener = Listener(listen[0], listen[1], me, secret)
    else:
        listener.me, listener.secret = me, secret
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
    pair = None
    if world_size == 2:
        try:
            pair = same_host.negotiate(
                rank, got["right"], left, same_host_cap(small_max_bytes),
                same_host.enabled_from_env() if shared_memory is None else shared_memory,
            )  # fmt: skip
        except BaseException:
            left.close()
            got["right"].close()
            raise
    return left, got["right"], pair
