"""The head's greedy choice under a token mask (structured output), per token: the argmax read
where the mask allows it (`SequenceSampler._greedy_allowed`) against the masked float64 copy of
the row that every masked choice built before, in one process, interleaved.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/bench/mask_choice.py [--vocab 49152] [--rounds 7]
        [--densities 0.95,0.02]

Per round and path: 16 random float32 rows of `--vocab` logits (SmolLM2's vocabulary by
default), each with a mask allowing a `density` fraction of the tokens and its argmax (the model
agreeing with the grammar, the common case), chosen 20 times each. Prints per density the median
microseconds per choice of each path and the median of the per-round ratios; the chosen ids
agree by construction (tests/unit/test_logits_process.py holds them equal).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tandem.engine.executor import StepResult
from tandem.engine.logits_process import SequenceSampler
from tandem.engine.sampling_params import SamplingParams


class FixedMask:
    """A mask whose allowed set the caller sets before each choice."""

    def __init__(self) -> None:
        self.keep = np.ones(1, dtype=bool)

    def allowed(self) -> np.ndarray:
        return self.keep

    def advance(self, token: int) -> None:
        pass


def per_choice_us(rows, keeps, quick: bool, repeats: int = 20) -> float:
    mask = FixedMask()
    s = SequenceSampler(SamplingParams(temperature=0), [0], mask)
    if not quick:
        s._greedy_allowed = lambda row, allowed: None  # the masked copy, as before
    t0 = time.perf_counter()
    for _ in range(repeats):
        for r, k in zip(rows, keeps):
            mask.keep = k
            s.choose(r, 0)
    return (time.perf_counter() - t0) / (repeats * len(rows)) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--densities", default="0.95,0.02")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows = [
        StepResult(logits=rng.standard_normal((1, a.vocab)).astype(np.float32)) for _ in range(16)
    ]
    for density in map(float, a.densities.split(",")):
        keeps = []
        for r in rows:
            k = rng.random(a.vocab) < density
            k[int(r.logits[0].argmax())] = True
            keeps.append(k)
        got: dict[str, list[float]] = {"copy": [], "quick": []}
        for i in range(a.rounds):
            for name in ("copy", "quick") if i % 2 == 0 else ("quick", "copy"):
                got[name].append(per_choice_us(rows, keeps, name == "quick"))
        ratio = statistics.median(q / c for q, c in zip(got["quick"], got["copy"]))
        print(f"vocab {a.vocab}, {density:.0%} allowed: masked copy "
              f"{statistics.median(got['copy']):.1f} us, argmax read "
              f"{statistics.median(got['quick']):.1f} us a choice, quick / copy {ratio:.3f} "
              f"(median of {a.rounds} interleaved rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
