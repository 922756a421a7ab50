"""Rows of every expert dealt to the ranks so that each rank's total follows its weight
(`--moe tp`): the balanced split of a mixture of experts whose width does not divide evenly.

Pure functions, no torch. E experts, each `units` blocks wide (the expert width over its block,
`TPPlan.expert_align`), go to N ranks with weights w. Every expert is still cut into contiguous
row spans in rank order (its gate/up rows and down columns tile `[0, width)` over the ranks that
hold part of it), but the cut may differ from expert to expert:

    T_r = apportion(E units, w)_r        rank r's blocks over all experts (largest remainder)
    b_r = floor(T_r / E),  x_r = T_r - E b_r   every expert gives r b_r blocks, x_r of them one more
    X   = units - sum_r b_r              extra blocks per expert (sum_r x_r = E X)

The extras are dealt row-major into an X-by-E table: rank 0's x_r cells first, then rank 1's,
...; column e lists the ranks that take one more block of expert e. A rank's x_r < E cells are
consecutive, so they fall in x_r different columns: expert e gives rank r `b_r + [r in column
e]` blocks, and rank r holds T_r blocks in all, within one block of its quota E units w_r / sum w.

Consecutive experts with the same cut form a group (`ExpertGroup`): within a group every expert
gives rank r the same rows, so its share of the group is one stacked (n_g, rows, ...) tensor of
uniform width and the kernels run it as they run any held experts. The cut changes between
experts e and e + 1 only where the dealt list changes rank inside a row of the table, which it
does at most N - 1 times: at most N groups. A rank holds those where its rows are not empty,
consecutive ones with the same rows merged into one; its groups never share an expert. At TP=2 on 3 blocks
(Qwen3-30B-A3B's width 768 in K-quant superblocks of 256): T = (3E/2, 3E/2), b = (1, 1), X = 1,
and the first E/2 experts give rank 0 two blocks, the last E/2 give rank 1 two: rank 0 holds
rows [0, 512) of experts [0, E/2) and [0, 256) of [E/2, E), rank 1 rows [512, 768) and
[256, 768). Where the width divides evenly (X = 0) there is one group: every expert cut alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.parallel.apportion import Span, apportion


@dataclass(frozen=True)
class ExpertGroup:
    """Experts `experts` and rows `rows` of each (both half-open) that one rank holds; the
    experts' down projections contribute those rows' columns."""

    experts: Span
    rows: Span

    @property
    def expert_rows(self) -> int:
        """Expert rows held: n_g (b - a)."""
        return self.experts.size * self.rows.size


def expert_cuts(n_experts: int, units: int, weights: tuple[float, ...]) -> list[tuple[int, ...]]:
    """Each expert's blocks per rank (module docstring): `cuts[e][r]`, summing to `units`."""
    n = len(weights)
    totals = apportion(n_experts * units, weights)
    base = [t // n_experts for t in totals]
    extra = [t - n_experts * b for t, b in zip(totals, base)]
    dealt = [r for r in range(n) for _ in range(extra[r])]  # row-major, X rows of E cells
    cuts = [list(base) for _ in range(n_experts)]
    for cell, r in enumerate(dealt):
        cuts[cell % n_experts][r] += 1
    return [tuple(c) for c in cuts]


def deal_expert_rows(
    n_experts: int, units: int, weights: tuple[float, ...], align: int
) -> tuple[tuple[ExpertGroup, ...], ...]:
    """Per rank, its groups of experts and their rows (in elements: blocks of `align`), in
    expert order (module docstring)."""
    cuts = expert_cuts(n_experts, units, weights)
    runs: list[tuple[int, int, tuple[int, ...]]] = []  # (first expert, end, cut)
    for e, cut in enumerate(cuts):
        if runs and runs[-1][2] == cut:
            runs[-1] = (runs[-1][0], e + 1, cut)
        else:
            runs.append((e, e + 1, cut))
    out: list[list[ExpertGroup]] = [[] for _ in weights]
    for first, end, cut in runs:
        start = 0
        for r, size in enumerate(cut):
            if size:
                rows = Span(start * align, (start + size) * align)
                mine = out[r]
                if mine and mine[-1].rows == rows and mine[-1].experts.end == first:
                    mine[-1] = ExpertGroup(Span(mine[-1].experts.start, end), rows)
                else:
                    mine.append(ExpertGroup(Span(first, end), rows))
            start += size
    return tuple(tuple(g) for g in out)
