"""Re-forming a TP group around the head's loaded shard: only the returning ranks load.

When a worker is lost and comes back (or a new one takes its place) for the same layout, the head's
shard is still right: the plan depends only on the model, the group size, the weights and the
attention ranks, and all four are unchanged. So the head keeps its model and re-forms only the
links: the new epoch's communicator replaces the old one under the same `MeteredCommunicator`
(every parallel layer holds that wrapper, so the layers follow), the sequence table is cleared
(every sequence is replayed from its tokens, `tandem.engine.recovery`), and the head runs the
setup collectives of `tp.setup.start_head` with the layout it already holds, minus the loading:

    head                                    a worker (`tp.setup.run_worker`, unchanged)
    measure (probe, collective)             measure
    exchange_rank_info                      exchange_rank_info
    agree_layout(kept layout, not probed)   agree_layout(None) -> the kept layout (no refinement)
    check_group_fit                         check_group_fit
    (keeps its shard)                       build_shard: loads its own slices
    gather_held (what each shard holds)     gather_held
    admit (conformance, judges)             admit

A worker cannot tell a kept head from a fresh one: the frames are the same. The conformance check
still runs, so a returning rank whose kernels are wrong is refused as at first join.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.comm.base import Communicator
from tandem.comm.metered import MeteredCommunicator
from tandem.engine.runner import ShardRunner
from tandem.engine.tp.head import TPExecutor
from tandem.engine.tp.held_experts import gather_held
from tandem.engine.tp.probe import measure
from tandem.engine.tp.setup import (
    admit,
    agree_layout,
    check_group_fit,
    exchange_rank_info,
    head_executor,
    rank_facts,
    setup_bound,
)
from tandem.loaders.source import open_model

if TYPE_CHECKING:
    from tandem.engine.tp.layout import WorkerProcesses

log = logging.getLogger(__name__)


class KeptShardError(RuntimeError):
    """The broken group's head cannot be kept for the new group (another size, no shard)."""


def keepable(ex: object) -> TPExecutor | None:
    """`ex` when it is a TP head whose shard a re-formed group of the same layout can keep (a
    metered communicator to relink, a layout it agreed on), else None."""
    if (
        isinstance(ex, TPExecutor)
        and isinstance(ex.comm, MeteredCommunicator)
        and ex.layout is not None
        and ex.ranks
    ):
        return ex
    return None


def _held_gb(runner: ShardRunner) -> float:
    """The bytes of the kept shard's parameters and buffers and of its KV cache, in GB."""
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    cache = runner.cache
    if cache is not None:
        tensors += [*cache.k.values(), *cache.v.values()]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e9


def rejoin_head(
    model_dir: str | Path,
    kept: TPExecutor,
    comm: Communicator,
    *,
    on_close: Callable[[], None] | None = None,
    keepalive_s: float | None = None,
    diagnose: Callable[[], str | None] | None = None,
    local_workers: WorkerProcesses | None = None,
    join_rtt_ms: dict[int, float] | None = None,
    setup_timeout: float | None = None,
    mem_limit_gb: float | None = None,
) -> TPExecutor:
    """Rank 0 of a new epoch's group over `comm` (formed, not metered), keeping `kept`'s loaded
    shard: see the module docstring. `kept` is the broken group's head, already closed."""
    layout, metered = kept.layout, kept.comm
    assert layout is not None and isinstance(metered, MeteredCommunicator)
    if comm.rank != 0 or comm.world_size != layout.world_size:
        comm.close()
        raise KeptShardError(
            f"the kept shard is rank 0 of {layout.world_size}; the new group has rank "
            f"{comm.rank} of {comm.world_size}"
        )
    metered.inner = comm  # the layers' collectives now run over the new epoch's links
    runner = kept.runner
    runner.seqs.clear()  # every sequence is replayed from its tokens
    dtype, device = kept.ranks[0].dtype, kept.facts[0].device if kept.facts else "cpu"
    md = open_model(model_dir)
    try:
        with setup_bound(metered, setup_timeout):
            # the shard and cache it keeps count as free: the plan's check adds them again
            probes = measure(metered, device, dtype, mem_limit_gb, held_gb=_held_gb(runner))
            ranks = exchange_rank_info(metered, dtype, device)
            # the kept shard fixes the weights: no decode at join refines them again
            layout = agree_layout(metered, replace(layout, probed=0), md.fingerprint())
            check_group_fit(md, layout, ranks, probes)
            loaded = gather_held(metered, runner.model)  # every returning rank has loaded
            plan = layout.plan(md)
            admit(metered, runner, ranks, md, plan)
        facts = [
            replace(f, probe=p.as_dict())
            for f, p in zip(rank_facts(md, plan, ranks, device, loaded), probes)
        ]
    except BaseException:
        comm.close()  # the next attempt relinks over its own links
        raise
    finally:
        md.close()
    log.warning(
        "the head kept its loaded shard; the group of %d ranks re-formed around it",
        layout.world_size,
    )
    return head_executor(
        runner,
        metered,
        kept.vocab_size,
        facts,
        ranks,
        layout,
        probes,
        placement=kept.placement,
        local_workers=local_workers,
        on_close=on_close,
        keepalive_s=keepalive_s,
        diagnose=diagnose,
        join_rtt_ms=join_rtt_ms,
    )
