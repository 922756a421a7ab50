"""longrope's switch, kept exact by recomputing a sequence when it crosses it (no torch).

A longrope model (Phi-3 with `rope_scaling` longrope) rotates every position of a sequence by its
short factor set while the sequence holds at most `switch` = original_max_position_embeddings
tokens and by its long set beyond (`models.rope`). Every hidden state of every layer depends on
those rotations, so when a sequence crosses the switch its whole KV cache is stale: transformers
drops its cache and recomputes the sequence at that step, and so do the head executors here.

`LongRopeRewind.expand(step)` turns each row whose cache was computed under the other set than the
row needs now (start > 0 and (start + n > switch) != the set its cache holds) into a rewind: the
sequence's tokens [0, start) (kept here, per live sequence) plus the row's new ones, from
position 0. The expanded step is what every rank and stage receives, so a TP group or a pipeline
recomputes it alike. A model without longrope (`switch` None) passes steps through untouched and
keeps no tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.engine.executor import Step, StepSequence


class LongRopeRewind:
    def __init__(self, switch: int | None) -> None:
        self.switch = switch
        self._tokens: dict[int, list[int]] = {}  # seq_id -> every token its cache holds
        self._long: dict[int, bool] = {}  # seq_id -> its cache computed under the long set

    @classmethod
    def for_config(cls, config) -> LongRopeRewind:
        s = config.rope_scaling
        return cls(s.original_max_position_embeddings if s and s.rope_type == "longrope" else None)

    def expand(self, step: Step) -> Step:
        """`step` with each row that crosses the switch (either way) rewound to position 0."""
        if self.switch is None:
            return step
        rows, changed = [], False
        for s in step.sequences:
            end = s.start_pos + len(s.token_ids)
            want = end > self.switch
            held = self._tokens.get(s.seq_id, [])
            if 0 < s.start_pos <= len(held) and self._long.get(s.seq_id, False) != want:
                s = StepSequence(s.seq_id, (*held[: s.start_pos], *s.token_ids), 0)
                changed = True
            self._tokens[s.seq_id] = held[: s.start_pos] + list(s.token_ids)
            self._long[s.seq_id] = want
            rows.append(s)
        return Step(tuple(rows), step.greedy) if changed else step

    def copy(self, src: int, dst: int, n: int) -> None:
        """`dst` starts as `src`'s first `n` tokens, computed under the set `src`'s cache was
        (a prefix copy: a later row that needs the other set recomputes it, as any row does)."""
        if self.switch is None:
            return
        self._tokens[dst] = self._tokens.get(src, [])[:n]
        self._long[dst] = self._long.get(src, False)

    def release(self, seq_ids: Iterable[int]) -> None:
        for i in seq_ids:
            self._tokens.pop(i, None)
            self._long.pop(i, None)

    def clear(self) -> None:
        self._tokens.clear()
        self._long.clear()
