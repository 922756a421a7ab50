"""A star's heartbeat connections: one between the root and each worker (`transport.heartbeat`).

Formed right after the star, through the same handshake and secret (role "beat"): the root
listens on a fresh port of its own address, tells each worker that port in one P2P frame over the
worker's formed channel, and accepts one heartbeat connection from each; a worker dials the port
it was told. The root then watches every worker and each worker watches the root, so a hung
worker is lost on the root, and a hung root on every worker, within the heartbeat timeout.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from tandem.transport.channel import Channel, UnexpectedFrameError
from tandem.transport.endpoints import Listener, connect
from tandem.transport.handshake import Identity
from tandem.wire import dtypes as wd
from tandem.wire import frame as fr


def form_star_heartbeats(
    me: Identity,
    channels: dict[int, Channel],
    host: str,
    secret: bytes | None,
    handshake_timeout: float,
) -> list[Channel]:
    """The heartbeat channels of rank `me.rank` (the root: one per worker; a worker: its one to
    the root), formed over the star's data `channels` (peer rank -> channel). `host`: the
    address the root's data listener is bound to (on the root), the root's address (on a
    worker)."""
    beat_me = replace(me, role="beat")
    if me.rank != 0:
        header, got = channels[0].recv_array(op=fr.P2P, seq=0, max_bytes=8)
        if header.dtype != wd.INT64.code or header.shape != (1,):
            raise UnexpectedFrameError(
                f"rank {me.rank}: expected the root's heartbeat port, got {header.describe()}"
            )
        port = int(np.frombuffer(got, dtype=np.int64)[0])
        return [
            connect(
                host, port, beat_me, secret, expect_rank=0,
                handshake_timeout=handshake_timeout, max_frame_bytes=64,
            )
        ]  # fmt: skip
    listener = Listener(host, 0, beat_me, secret)
    beats: list[Channel] = []
    try:
        port = np.array([listener.port], dtype=np.int64).tobytes()
        for ch in channels.values():
            ch.send_array(op=fr.P2P, seq=0, dtype_code=wd.INT64.code, shape=(1,), payload=port)
        deadline = time.monotonic() + handshake_timeout
        want = set(channels)
        while want:
            ch = listener.accept(
                set(want), timeout=max(0.1, deadline - time.monotonic()), max_frame_bytes=64
            )
            want.discard(ch.peer_rank)
            beats.append(ch)
    except BaseException:
        for ch in beats:
            ch.close()
        raise
    finally:
        listener.close()
    return beats
