"""A pipeline stage that is itself a tensor-parallel group: its ring and its rank's shard.

Each stage of a grid forms its own `RingCommunicator` among its TP ranks (its own cluster id, so a
frame of one stage's ring can never be taken for another's), then builds this rank's shard of the
stage's layers with the TP transform (`shard_transformer`: q/k/v and gate/up column-parallel, o and
down row-parallel, kv-head groups and intermediate rows tiled by `plan_for_config`) and reads only
its own slices (`load_shard`). The stage holds no embedding and no LM head: the head keeps both.
"""

from __future__ import annotations

import torch

from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S
from tandem.comm.base import Communicator
from tandem.comm.ring import RingCommunicator
from tandem.kernels.prepare import prepare
from tandem.loaders.source import ModelSource
from tandem.models.llama import Transformer
from tandem.parallel.plan import plan_for_source
from tandem.parallel.shard_load import load_shard, quant_types
from tandem.parallel.transform import shard_transformer
from tandem.transport.endpoints import Listener
from tandem.transport.handshake import Identity


def ring_listener(host: str = "127.0.0.1", port: int = 0) -> Listener:
    """A listener bound before the ring forms, so its (ephemeral) port can be reported first; the
    ring sets its identity and secret when it forms."""
    return Listener(host, port, Identity("unset", 0, 1), None)


def form_stage_ring(
    tp_rank: int,
    tp_size: int,
    listener: Listener,
    right: str,
    *,
    secret: bytes | None,
    cluster_id: str,
    fingerprint: str,
    timeout: float,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> Communicator:
    """This rank's communicator in its stage's TP ring; `right` is rank (r+1) % N's host:port.
    Its links carry heartbeats (`transport.heartbeat`; 0: none), so a collective waiting on a hung
    stage peer fails within `heartbeat_timeout` rather than the op timeout."""
    host, _, port = right.rpartition(":")
    return RingCommunicator.create(
        tp_rank,
        tp_size,
        right=(host, int(port)),
        listener=listener,
        secret=secret,
        cluster_id=cluster_id,
        model_fingerprint=fingerprint,
        handshake_timeout=max(timeout, 60.0),
        op_timeout=timeout,
        heartbeat_timeout=heartbeat_timeout,
    )


def load_tp_stage(
    md: ModelSource,
    layer_range: tuple[int, int],
    comm: Communicator,
    *,
    weights: tuple[float, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    kernels: str = "auto",
) -> Transformer:
    """This rank's shard of layers `[start, end)`, loaded slice by slice, put on `kernels`
    (`tandem.kernels.prepare`: "auto" the native quantized kernels, "torch" the reference)."""
    plan = plan_for_source(md, comm.world_size, weights)
    model = shard_transformer(
        md.config,
        plan,
        comm,
        layer_range=layer_range,
        with_embed=False,
        with_head=False,
        device=device,
        dtype=dtype,
        qtypes=quant_types(md),
    ).eval()
    load_shard(model, md, plan, comm.rank)
    prepare(model, kernel=kernels)
    return model
