"""A pipeline stage process: `tandem stage --model DIR --stage K ...` (started by the launcher).

One process is one TP rank of one stage. It binds its listening socket first and prints
`TANDEM_STAGE_LISTENING <port>` on stdout (so a launcher can learn an ephemeral port), loads only its
layers (its TP shard of them when the stage is a TP group), opens its links, and serves frames until
STOP (see `tandem.engine.pp.stage.serve_stage`). With `--layers auto` it first measures its decode
GEMV speed and free memory (`tandem.engine.device_probe.measure_local`, before any layer is loaded),
adds both to that line (`TANDEM_STAGE_LISTENING <port> <ring port> <GB/s> <free GB>`), and reads
its range `START:END` as the first stdin line (the launcher partitions the layers from every
stage's probe: `tandem.engine.pp.layout.auto_ranges`). The stage's leader (TP rank 0) learns
where to send from `--downstream host:port,...` or, with `--downstream -`, from a line on stdin; a
TP rank of a stage also binds a ring listener (its port is the second number printed) and learns
its right neighbour from `--tp-right` or the next stdin line.

With `--beat host:port` the process dials the head's heartbeat listener once its links are up and
beats to it (`tandem.engine.pp.beats`); a head silent for `--heartbeat-timeout` is lost: the
process shuts its links down and leaves. Its stage links to and from other stage processes (not
the head) then carry heartbeats of their own on the same thread: a neighbour silent there is
reported to the head, which declares it lost and ends the group.

The cluster secret comes from the environment (`TANDEM_SECRET`), never from argv.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

import torch

from tandem.cluster.ring_config import DEFAULT_HEARTBEAT_TIMEOUT_S
from tandem.devices import DTYPE_NAMES
from tandem.engine import device_probe
from tandem.engine.pp.beats import accept_link_beat, dial_beat, dial_link_beat, offer_link_beat
from tandem.engine.pp.links import LinkTerms, StageListener, dial_all, max_frame_bytes
from tandem.engine.pp.stage import StageLinks, StageRunner, serve_stage
from tandem.engine.pp.tp_stage import form_stage_ring, load_tp_stage, ring_listener
from tandem.kernels import mapped_guard
from tandem.kernels.prepare import prepare
from tandem.loaders.load import load_model
from tandem.loaders.source import ModelSource, open_model
from tandem.transport.heartbeat import Heartbeat, PeerLostError

READY = "TANDEM_STAGE_LISTENING"


@dataclass(frozen=True)
class StageOptions:
    """Where this process sits in the pipeline grid and how it runs (`tandem stage` parses them)."""

    model: str
    stage: int
    layers: str  # the half-open layer range START:END, or "auto": probe, then read it on stdin
    rank: int  # global rank in the pipeline grid
    world_size: int
    upstream_rank: int
    cluster_id: str
    last: bool = False  # the last stage: sends back to the head
    downstream_ranks: str = ""  # global ranks this leader sends to
    downstream: str = ""  # host:port,... of those ranks, or - for stdin
    tp_rank: int = 0
    tp_size: int = 1
    tp_right: str = "-"  # host:port of TP rank r+1's ring listener, or - for stdin
    tp_listen: str = "127.0.0.1:0"
    listen: str = "127.0.0.1:0"
    dtype: str = "float32"
    device: str = "cpu"
    wire_dtype: str = "float32"
    max_batch: int = 8
    max_seq_len: int = 2048
    timeout: float = 120.0  # per-op link timeout, seconds
    idle_timeout: float = 3600.0  # leave after this long idle
    threads: int = 0  # torch threads (0: leave the default)
    kernels: str = "auto"  # tandem.kernels.prepare's choice; "torch": the reference modules
    beat: str = ""  # host:port of the head's heartbeat listener ("": no heartbeat to the head)
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S  # 0: no heartbeats


def load_stage(args: StageOptions, md: ModelSource, layer_range: tuple[int, int], ring):
    """This rank's layers: the whole range at TP=1, else its TP shard (joined to the stage ring)."""
    dtype = DTYPE_NAMES[args.dtype]
    if args.tp_size == 1:
        model = load_model(
            md,
            dtype=dtype,
            device=args.device,
            layer_range=layer_range,
            with_embed=False,
            with_head=False,
        )
        prepare(model, kernel=args.kernels)  # the single-node fast path (tandem.kernels)
        return model, None
    right = args.tp_right if args.tp_right != "-" else sys.stdin.readline().strip()
    comm = form_stage_ring(
        args.tp_rank,
        args.tp_size,
        ring,
        right,
        secret=_secret(),
        cluster_id=f"{args.cluster_id}/stage{args.stage}",
        fingerprint=md.fingerprint(),
        timeout=args.timeout,
        heartbeat_timeout=args.heartbeat_timeout,
    )
    shard = load_tp_stage(
        md, layer_range, comm, dtype=dtype, device=args.device, kernels=args.kernels
    )
    return shard, comm


def _secret() -> bytes | None:
    s = os.environ.get("TANDEM_SECRET")
    return s.encode() if s else None


def _cut(links: StageLinks, e: PeerLostError, lost: list[PeerLostError]) -> None:
    """A peer is lost (on the heartbeat thread). The head: noted in `lost`, and every link shut
    down, so the stage loop wakes from its wait and leaves (`serve_stage` raises StageLinkError,
    raised again with the loss as its cause). A neighbour stage: the heartbeat has reported it to the head,
    which ends the group; the links stay as they are, so the head's reason is the loss, not this
    stage leaving."""
    if e.rank != 0:
        logging.getLogger(__name__).error("reported to the head: %s", e)
        return
    logging.getLogger(__name__).error("the head is lost, leaving: %s", e)
    lost.append(e)
    for link in (links.upstream, *links.downstream):
        shutdown = getattr(link, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _link_beats(args: StageOptions, terms: LinkTerms, host: str, links: StageLinks, addrs: str):
    """The heartbeat channels of this process's stage links that do not touch the head
    (`tandem.engine.pp.beats`): offered up the upstream link first (it never blocks), then dialed
    down each downstream link, then accepted from upstream, so no two ranks wait on each other."""
    offer = None
    if args.upstream_rank != 0:
        offer = offer_link_beat(terms, args.rank, host, links.upstream.channel)
    out = []
    try:
        ranks = [int(r) for r in args.downstream_ranks.split(",")] if args.downstream_ranks else []
        for link, to_rank, addr in zip(links.downstream, ranks, addrs.split(","), strict=False):
            if to_rank != 0:
                to_host = addr.rpartition(":")[0]
                out.append(dial_link_beat(terms, args.rank, to_rank, to_host, link.channel))
        if offer is not None:
            out.append(accept_link_beat(offer, terms, args.upstream_rank))
    except BaseException:
        if offer is not None:
            offer.close()
        for ch in out:
            ch.close()
        raise
    return out


def run_stage(args: StageOptions) -> int:
    """Serves this stage until STOP (module docstring)."""
    logging.basicConfig(level=logging.INFO, format=f"stage {args.stage}.{args.tp_rank} %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    md = open_model(args.model)
    mapped_guard.watch(md)  # its GGUF blocks stay mapped: a SIGBUS on them is named (exit 85)
    cfg = md.config
    auto = args.layers == "auto"
    terms = LinkTerms(
        cluster_id=args.cluster_id,
        world_size=args.world_size,
        wire_dtype=args.wire_dtype,
        model_fingerprint=md.fingerprint(),
        secret=_secret(),
        op_timeout=args.timeout,
        handshake_timeout=max(args.timeout, 60.0),
        max_frame_bytes=max_frame_bytes(args.max_batch, args.max_seq_len, cfg.hidden_size),
    )
    host, _, port = args.listen.rpartition(":")
    listener = StageListener(terms, args.rank, host, int(port))
    ring = None
    if args.tp_size > 1:
        rhost, _, rport = args.tp_listen.rpartition(":")
        ring = ring_listener(rhost, int(rport))
    ready = f"{READY} {listener.port} {ring.port if ring else 0}"
    if auto:
        gemv, free = device_probe.measure_local(args.device, args.dtype)
        ready += f" {gemv:.6g} {free:.6g}"
    print(ready, flush=True)
    layers = sys.stdin.readline().strip() if auto else args.layers
    a, b = (int(x) for x in layers.split(":"))
    name = f"stage {args.stage}" + (f" (TP rank {args.tp_rank})" if args.tp_size > 1 else "")

    box: dict = {}

    def accept() -> None:
        try:
            box["up"] = listener.accept(args.upstream_rank, f"{name} <- rank {args.upstream_rank}")
        except Exception as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    # stdin, when used (after the range under --layers auto): the downstream addresses (empty
    # off the leader), then the ring's right neighbour
    addrs = sys.stdin.readline().strip() if args.downstream == "-" else args.downstream
    model, comm = load_stage(args, md, (a, b), ring)
    runner = StageRunner(model, args.max_batch, args.max_seq_len)
    downstream = []
    if args.downstream_ranks:
        ranks = [int(r) for r in args.downstream_ranks.split(",")]
        downstream = dial_all(terms, args.rank, addrs.split(","), ranks, name)
    acceptor.join()
    listener.close()
    if "err" in box:
        raise box["err"]
    links = StageLinks(upstream=box["up"], downstream=downstream, to_head=args.last)
    beat = None
    lost: list[PeerLostError] = []  # the head, lost by this process's heartbeat (`_cut`)
    if args.beat and args.heartbeat_timeout > 0:
        channels = [dial_beat(terms, args.rank, args.beat)]
        channels += _link_beats(args, terms, host, links, addrs)
        beat = Heartbeat(
            args.rank,
            channels,
            args.heartbeat_timeout,
            lambda e: _cut(links, e, lost),
            report_to=0,
        )
    try:
        serve_stage(
            runner, links, name=name, wire_dtype=args.wire_dtype, idle_timeout=args.idle_timeout
        )
    except Exception as err:
        if lost:  # the heartbeat cut the links: the loss is why this stage leaves, and its exit
            raise err from lost[0]  # code says so (PEER_LOST_EXIT, `cluster.exits`)
        raise
    finally:
        if beat is not None:
            beat.close()
        for link in downstream:
            link.close()
        box["up"].close()
        if comm is not None:
            comm.close()
    return 0
