"""`LocalExecutor`: the whole model on one device; the reference every distributed executor matches.

Each live sequence owns one row ("slot") of the preallocated KV cache; `run` checks that a step
continues each sequence where its cache ends, runs one batched forward, and returns the logits of
each sequence's last new token.

On construction the model is put in its execution form (`tandem.kernels.prepare`): the fast
modules swapped in and each linear layer on the measured-best kernel for its device and dtype;
`kernels="torch"` keeps the reference modules and F.linear.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tandem.engine import cluster_info as ci
from tandem.engine.executor import Step, StepResult
from tandem.kernels.prepare import prepare
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.kv_cache import KVCache, SequenceTooLongError, SlotTable
from tandem.models.llama import Transformer


class StepError(ValueError):
    """A step that does not continue its sequences: a gap in positions, a bad token id, or too
    many sequences."""


class LocalExecutor:
    def __init__(
        self,
        model: Transformer,
        max_batch: int = 8,
        max_seq_len: int = 2048,
        *,
        kernels: str = "auto",
        weight_format: str | None = None,
    ) -> None:
        cfg = model.config
        self.weight_format = weight_format  # how the weights were stored (for describe)
        self.kernels = prepare(model, kernel=kernels)  # in place, once
        self.model = model
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = min(max_seq_len, cfg.max_position_embeddings)
        self.max_batch = max_batch
        self.cache = KVCache.for_model(model, max_batch, self.max_seq_len)
        self.slots = SlotTable(max_batch)
        self._cached: dict[int, int] = {}  # seq_id -> tokens in its cache row

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 8,
        max_seq_len: int = 2048,
        kernels: str = "auto",
    ) -> LocalExecutor:
        md = open_model(path)
        model = load_model(md, dtype=dtype, device=device)
        return cls(model, max_batch, max_seq_len, kernels=kernels, weight_format=md.weight_format())

    def _check(self, step: Step) -> None:
        seqs = step.sequences
        if not seqs or len(seqs) > self.max_batch:
            raise StepError(f"a step holds 1..{self.max_batch} sequences, got {len(seqs)}")
        if len({s.seq_id for s in seqs}) != len(seqs):
            raise StepError("a sequence appears twice in one step")
        new = sum(s.seq_id not in self.slots for s in seqs)
        if new > len(self.slots._free):
            raise StepError(
                f"{new} new sequences but only {len(self.slots._free)} free cache slots"
            )
        for s in seqs:
            if not s.token_ids:
                raise StepError(f"sequence {s.seq_id}: no tokens")
            cached = self._cached.get(s.seq_id, 0)
            if not 0 <= s.start_pos <= cached:
                raise StepError(
                    f"sequence {s.seq_id}: start_pos {s.start_pos} but {cached} tokens are cached"
                )
            if s.start_pos + len(s.token_ids) > self.max_seq_len:
                raise SequenceTooLongError(
                    f"sequence {s.seq_id} would reach {s.start_pos + len(s.token_ids)} tokens; "
                    f"max_seq_len is {self.max_seq_len}"
                )
            if min(s.token_ids) < 0 or max(s.token_ids) >= self.vocab_size:
                raise StepError(f"sequence {s.seq_id}: token id outside [0, {self.vocab_size})")

    @torch.inference_mode()
    def run(self, step: Step) -> StepResult:
        self._check(step)
        seqs = step.sequences
        slots = [self.slots.slot(s.seq_id) for s in seqs]
        lengths = [len(s.token_ids) for s in seqs]
        T = max(lengths)
        rows = [list(s.token_ids) + [0] * (T - len(s.token_ids)) for s in seqs]
        tokens = torch.tensor(rows, dtype=torch.int64, device=self.model.device)  # (B, T)
        m = self.model
        ctx = m.context([s.start_pos for s in seqs], lengths, self.cache, slots)
        h = m.forward_layers(m.embed(tokens), ctx)  # (B, T, D)
        for s in seqs:
            self._cached[s.seq_id] = s.start_pos + len(s.token_ids)
        if step.greedy:
            return StepResult(token_ids=m.head_argmax(m.last_hidden(h, ctx))[:, 0].cpu())  # (B,)
        logits = m.head(m.last_hidden(h, ctx))[:, 0]  # (B, vocab)
        return StepResult(logits=logits.float().cpu())

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.slots.release(i)
            self._cached.pop(i, None)

    def health(self) -> tuple[bool, str]:
        """One process: whole while it runs."""
        return True, "ok"

    def stats(self) -> dict[str, float]:
        """No collectives and no wire."""
        return {}

    def describe(self) -> dict[str, Any]:
        """One rank holding every layer, in this process."""
        m = self.model
        facts = ci.RankFacts(
            rank=0,
            role="head",
            host=ci.hostname(),
            device=str(m.device),
            dtype=str(m.dtype).removeprefix("torch."),
            weight_format=self.weight_format,
            shard=ci.layer_shard((0, m.config.num_hidden_layers)),
            work_share=1.0,
            pid=os.getpid(),
            local=True,
            threads=torch.get_num_threads(),
        )
        return ci.Description("single", 1, 1, [facts]).as_dict()

    def close(self) -> None:
        self._cached.clear()
