"""Shared by the prefix copy tests (tests/unit/test_prefix_copy.py, tests/distributed/
test_prefix_copy_processes.py): steps of one sequence through any `Executor`, and the check that
a request continued from a copied prefix gives the logits of the same request run cold."""

from __future__ import annotations

import numpy as np

from tandem.engine.executor import Step, StepSequence


def prompt_of(seed: int, n: int, vocab: int = 512) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def run(ex, seq_id: int, tokens, pos: int) -> np.ndarray:
    """One step of one sequence: its logits (1, vocab)."""
    return np.asarray(ex.run(Step((StepSequence(seq_id, tuple(tokens), pos),))).logits)


def chunks(ex, seq_id: int, tokens, start: int, chunk: int) -> np.ndarray:
    """`tokens` from `start` on, prefilled in steps of `chunk`; the last step's logits."""
    out = None
    for i in range(start, len(tokens), chunk):
        out = run(ex, seq_id, tokens[i : i + chunk], i)
    return out


def decode(ex, seq_id: int, pos: int, first: int, n: int) -> list[np.ndarray]:
    """n greedy decode steps from `first` at `pos`: each step's logits."""
    outs, tok = [], first
    for k in range(n):
        logits = run(ex, seq_id, [tok], pos + k)
        outs.append(logits)
        tok = int(logits[0].argmax())
    return outs


def check_copy_equals_cold(ex, cold, n: int, ids=(0, 1, 5, 6), chunk: int = 16) -> None:
    """Sequence ids[0] prefills a 60-token source and decodes one token; ids[1] copies its first
    n positions, prefills the rest of a prompt that parts from the source at n and decodes 4
    tokens: every logit equals `cold`'s (which may be `ex`) for the same prompt prefilled from
    0 as sequence ids[2], and the source's next step equals its cold run as ids[3]."""
    src, dst, cold_dst, cold_src = ids
    source = prompt_of(0, 60)
    chunks(ex, src, source, 0, chunk)
    src_next = run(ex, src, [7], 60)
    prompt = source[:n] + prompt_of(1, 15)
    ex.copy_prefix(src, dst, n)
    got = [chunks(ex, dst, prompt, n, chunk)]
    got += decode(ex, dst, len(prompt), int(got[0][0].argmax()), 4)
    want = [chunks(cold, cold_dst, prompt, 0, chunk)]
    want += decode(cold, cold_dst, len(prompt), int(want[0][0].argmax()), 4)
    for g, w in zip(got, want):
        assert np.array_equal(g, w), float(np.abs(g - w).max())
    chunks(cold, cold_src, source, 0, chunk)
    assert np.array_equal(src_next, run(cold, cold_src, [7], 60))
    assert np.array_equal(run(ex, src, [9], 61), run(cold, cold_src, [9], 61))
