"""Batch invariance across real processes on loopback: TP=2 and TP=3 groups (the head and
`tandem worker`s, over the TCP ring) and a PP=2 pipeline (the head and one stage process) on
BF16, Q8_0 and K-quant GGUFs. For step compositions drawn by Hypothesis (1-16 sequences,
prefilled in one step or in chunks beside others' decode tokens, joining late, sitting steps
out, leaving, slots reused), and always one seeded composition that takes all 16 slots, each
sequence's logits after every step equal, bit for bit, the same tokens run alone through the same
group (one-step prefill, then one decode token per step). Equality is per layout: a TP=2 group
against itself alone, not against the single node (its shard sums add in another order).

Why it holds beyond one process: each rank's shard computes a row from that row alone (the
modules of tests/unit/test_batch_invariance.py), the ring's all-reduce sums each element in an
order set by its column alone (`comm.algorithms`: column chunks, RANK_ORDER in the same ring
order), and a pipeline's hidden state crosses the wire element by element in float32. The full
composition's steps hold more than 102 rows of 160 float32 columns, past the 64 KB cut-over where
the ring's RING algorithm takes over from RANK_ORDER, while a sequence alone stays under it: at
TP=3 both algorithms meet in one comparison.
"""

from __future__ import annotations

import random

import pytest
from invariance_support import QTYPES, property_run, random_composition, write_tiny_gguf

from tandem.engine.pp.launch import StageSpec, launch_pipeline
from tandem.engine.tp.local import launch_local_tp
from tandem.kernels import native
from tandem.parallel.partition import LayerRange as R

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

MAX_BATCH, MAX_LEN = 16, 40
# every slot taken, some reused after others leave: its steps pass the ring's 64 KB cut-over
FULL = 16, 13
DRAWN = 3  # compositions Hypothesis draws per group, unshrunk (time: each is a few dozen steps)


def launch(layout: str, f):
    common = dict(max_batch=MAX_BATCH, max_seq_len=MAX_LEN, threads=1)
    if layout in ("tp2", "tp3"):
        return launch_local_tp(f, int(layout[2]), **common)
    return launch_pipeline(f, [StageSpec(R(0, 1)), StageSpec(R(1, 2))], timeout=60, **common)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("layout", ["tp2", "tp3", "pp2"])
def test_each_sequences_logits_are_the_same_bits_alone_or_in_any_step_across_processes(
    tmp_path, layout, qtype
):
    f = write_tiny_gguf(tmp_path / f"tiny-qwen3-{qtype}.gguf", qtype)
    ex = launch(layout, f)
    try:
        n, seed = FULL
        rng = random.Random(seed)
        full = (random_composition(rng, n), rng)
        property_run(ex, ex, DRAWN, shrink=False, explicit=(full,), max_seqs=MAX_BATCH)
    finally:
        ex.close()
