"""The `--tp` options of `tandem generate` (not a command), and the communication figures added to
the JSON (`tandem.cli.layout_args` turns them into a `Layout`).

`--tp N` on one machine launches N-1 local `tandem worker` processes on loopback and keeps the head
(rank 0) in this process. With `RING_CONFIG` set, the ring is the one that file describes (each other
node runs `tandem worker --model DIR` with its own RING_CONFIG) and nothing is launched.
`--dtype` and `--device` take one value for every rank or a comma list, one per rank.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch: only a TP group's head, which already imported them, passes these
    from tandem.comm.metered import CommStats
    from tandem.engine.tp.head import TPExecutor

ATTN_HELP = "attention on the first A ranks of the TP group only, the MLP on every rank"
MOE_HELP = (
    "a mixture of experts' placement in the TP group: tp (default: rows of every expert on every "
    "rank) or experts (whole experts per rank, their count by the ranks' weights)"
)


def add_moe_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moe", choices=("tp", "experts"), default="tp", help=MOE_HELP)


def add_tp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (head included)")
    p.add_argument(
        "--tp-weights",
        help="share of the work per rank, e.g. 2,1, or auto: from each rank's decode GEMV speed "
        "measured as the group forms (default: auto where the ranks differ in device, dtype, "
        "host, threads or CPU quota, else equal)",
    )
    p.add_argument("--attn-ranks", type=int, default=None, metavar="A", help=ATTN_HELP)
    add_moe_argument(p)
    p.add_argument("--op-timeout", type=float, default=60.0, help="seconds any collective may take")


class TPMeter:
    """Snapshots the group's communication counters at the start and at the first sampled token
    (the end of prefill), so the per-token figures cover decode alone."""

    def __init__(self, ex: TPExecutor) -> None:
        self.ex = ex
        self.at_start = ex.comm_stats.copy()
        self.at_first: CommStats | None = None
        self.tokens = 0

    def token(self) -> None:
        if self.at_first is None:
            self.at_first = self.ex.comm_stats.copy()
        self.tokens += 1

    def report(self) -> dict:
        return comm_report(self.ex, self.at_start, self.at_first, max(0, self.tokens - 1))


def comm_report(
    ex: TPExecutor, at_start: CommStats, at_first: CommStats | None, decode_tokens: int
) -> dict:
    """Per-token communication figures of the decode phase (after the first token), plus prefill."""
    end = ex.comm_stats.copy()
    out: dict = {
        "tp": ex.comm.world_size,
        "tp_weights": list(ex.layout.weights),
        "attn_ranks": ex.layout.attn_ranks or ex.comm.world_size,
        "ranks": [
            {"rank": r.rank, "dtype": r.dtype, "device": r.device, "threads": r.threads}
            for r in ex.ranks
        ],
    }
    if at_first is not None:
        pre = at_first.minus(at_start)
        out["prefill_comm"] = {
            "collectives": pre.collectives,
            "bytes_on_wire": pre.bytes_moved,
            "seconds_in_collectives": round(pre.seconds, 6),
        }
    if at_first is not None and decode_tokens > 0:
        dec = end.minus(at_first)
        out["comm_per_token"] = {
            "collectives": dec.collectives / decode_tokens,
            "bytes_on_wire": dec.bytes_moved / decode_tokens,
            "ms_in_collectives": round(1000 * dec.seconds / decode_tokens, 4),
        }
    return out
