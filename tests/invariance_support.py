"""Shared by the batch-invariance tests (tests/unit/test_batch_invariance.py, tests/distributed/
test_batch_invariance_processes.py): step compositions (seeded, or drawn by Hypothesis), running
one through any `Executor`, the same sequences run alone, the bit-for-bit comparison, and the
property run over drawn compositions."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tandem.engine.executor import Step, StepSequence
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

# widths with vector tails (160 = 2.5 x 64 bf16 pairs, 224 = 7 blocks of 32)
SHAPE = dict(
    hidden_size=160, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32,
)  # fmt: skip
VOCAB = 512  # tiny-qwen3's
QTYPES = ["BF16", "Q8_0", "K_MIX"]


def write_tiny_gguf(out, qtype: str):
    """tiny-qwen3 at SHAPE (2 layers, q/k norms, tied head) as a GGUF file of `qtype`."""
    cfg = dataclasses.replace(get_preset("tiny-qwen3").config, **SHAPE)
    _, (f,) = write_preset_gguf(out, "tiny-qwen3", qtype, config=cfg)
    return f


@dataclass(frozen=True)
class Seq:
    """One sequence of a composition: its prompt cut into prefill chunks, then its decode
    tokens (fed, not sampled), starting at step `join`."""

    seq_id: int
    chunks: tuple[tuple[int, ...], ...]
    decode: tuple[int, ...]
    join: int

    @property
    def pieces(self) -> list[tuple[int, ...]]:
        return [*self.chunks, *((t,) for t in self.decode)]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for p in self.pieces for t in p)


def random_composition(
    rng: random.Random, n: int, max_prompt: int = 20, vocab: int = VOCAB
) -> list[Seq]:
    """n sequences: prompts of 1..max_prompt tokens in 1-3 chunks, 0-4 decode tokens, joining
    at steps 0-3."""
    seqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        cuts = sorted(
            set(rng.sample(range(1, len(prompt)), min(len(prompt) - 1, rng.randint(0, 2))))
        )
        bounds = [0, *cuts, len(prompt)]
        chunks = tuple(tuple(prompt[a:b]) for a, b in zip(bounds, bounds[1:]))
        decode = tuple(rng.randrange(vocab) for _ in range(rng.randint(0, 4)))
        seqs.append(Seq(i, chunks, decode, rng.randint(0, 3)))
    return seqs


def as_numpy(x) -> np.ndarray:
    return x.float().numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x


def run_mixed(ex, seqs: list[Seq], rnd: random.Random) -> dict[tuple[int, int], np.ndarray]:
    """Runs the composition through `ex`: each step, every live sequence (joined, not done)
    brings its next piece unless `rnd` has it sit the step out (one always comes), the rows in
    `rnd`'s order; a sequence done is released, its slot free for a later one.
    -> {(seq_id, tokens so far): its logits after that step}."""
    queue = {s.seq_id: s.pieces for s in seqs}
    pos = {s.seq_id: 0 for s in seqs}
    out: dict[tuple[int, int], np.ndarray] = {}
    step_no = 0
    try:
        while any(queue.values()):
            live = [s for s in seqs if queue[s.seq_id] and s.join <= step_no]
            rows = [s for s in live if rnd.random() >= 0.25] or live[:1]
            rnd.shuffle(rows)
            step_no += 1
            if not rows:
                continue
            step = Step(
                tuple(StepSequence(s.seq_id, queue[s.seq_id][0], pos[s.seq_id]) for s in rows)
            )
            logits = as_numpy(ex.run(step).logits)
            for b, s in enumerate(rows):
                pos[s.seq_id] += len(queue[s.seq_id].pop(0))
                out[(s.seq_id, pos[s.seq_id])] = logits[b].copy()
                if not queue[s.seq_id]:
                    ex.release([s.seq_id])
    finally:
        ex.release([s.seq_id for s in seqs if queue[s.seq_id] and pos[s.seq_id]])
    return out


def run_alone(ex, s: Seq, seq_id: int = 0) -> dict[int, np.ndarray]:
    """The sequence alone in every step: its prompt in one step, then one decode token per step;
    each chunk end inside the prompt as the one-step prefill of the prompt up to there.
    -> {tokens so far: logits}."""
    toks, n = s.tokens, sum(len(c) for c in s.chunks)
    out = {}

    def one(tokens: tuple[int, ...], start: int) -> np.ndarray:
        return as_numpy(ex.run(Step((StepSequence(seq_id, tokens, start),))).logits)[0].copy()

    for end in [sum(len(c) for c in s.chunks[: i + 1]) for i in range(len(s.chunks) - 1)]:
        out[end] = one(toks[:end], 0)
        ex.release([seq_id])
    out[n] = one(toks[:n], 0)
    for p in range(n, len(toks)):
        out[p + 1] = one((toks[p],), p)
    ex.release([seq_id])
    return out


def check_invariant(mixed_ex, alone_ex, seqs: list[Seq], rnd: random.Random) -> None:
    """Every logits row of the composition run through `mixed_ex` equals, bit for bit, the same
    sequence's run alone through `alone_ex` (which may be the same executor)."""
    mixed = run_mixed(mixed_ex, seqs, rnd)
    for s in seqs:
        for end, want in run_alone(alone_ex, s).items():
            got = mixed[(s.seq_id, end)]
            assert np.array_equal(got, want), (
                f"sequence {s.seq_id} after {end} tokens: max |diff| "
                f"{float(np.abs(got - want).max()):.3g}"
            )


@st.composite
def compositions(draw, max_seqs: int = 16, max_prompt: int = 20):
    """(sequences, rnd): rnd decides, step by step, which live sequences sit the step out and
    the order of the step's rows."""
    n = draw(st.integers(1, max_seqs))
    tok = st.integers(0, VOCAB - 1)
    seqs = []
    for i in range(n):
        prompt = draw(st.lists(tok, min_size=1, max_size=max_prompt))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(prompt) - 1)), max_size=2)))
        cuts = [c for c in cuts if c < len(prompt)]
        bounds = [0, *cuts, len(prompt)]
        chunks = tuple(tuple(prompt[a:b]) for a, b in zip(bounds, bounds[1:]))
        decode = tuple(draw(st.lists(tok, max_size=4)))
        seqs.append(Seq(i, chunks, decode, draw(st.integers(0, 3))))
    return seqs, draw(st.randoms(use_true_random=False))


def property_run(
    mixed_ex, alone_ex, examples: int, shrink: bool = True, explicit: tuple = (), max_seqs: int = 16
) -> None:
    """Hypothesis over `compositions(max_seqs)`: `examples` drawn ones (shrunk on a failure when
    `shrink`), after the `explicit` cases ((sequences, rnd) each), which always run."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(max_examples=examples, deadline=None, phases=phases, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(compositions(max_seqs))
    def prop(case) -> None:
        check_invariant(mixed_ex, alone_ex, *case)

    for case in explicit:
        prop = example(case)(prop)
    prop()
