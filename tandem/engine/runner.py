"""Runs one `Step` through the part of the model this process holds, with its own KV cache.

The same object serves every layout: a single device (the whole model), a tensor-parallel rank (a
`shard_transformer` model whose collectives run inside its layers), or a pipeline stage (a layer
range, with or without the embedding and the head). Each rank of a group runs the same steps in
the same order, so each assigns the same cache slots; nothing here talks to other ranks except
through the model's own layers.
"""

from __future__ import annotations

import torch

from tandem.engine.executor import Step
from tandem.kernels.modules import swap_fast_modules
from tandem.models.kv_cache import KVCache, SlotTable
from tandem.models.llama import Transformer


class StepOrderError(ValueError):
    """A step's start position disagrees with how many tokens the cache holds for that sequence."""


class ShardRunner:
    def __init__(self, model: Transformer, max_batch: int, max_seq_len: int) -> None:
        swap_fast_modules(model)  # the native norms, RoPE and attention; TP layers pick their own
        self.model = model
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.cache = KVCache.for_model(model, max_batch, max_seq_len)
        self.slots = SlotTable(max_batch)
        self._cached: dict[int, int] = {}  # seq_id -> tokens already in the cache

    @torch.inference_mode()
    def forward(self, step: Step, h_in: torch.Tensor | None = None) -> torch.Tensor | None:
        """With the embedding, `h_in` is None and the tokens come from `step`; otherwise `h_in` is
        the previous stage's hidden state (B, T, D). Returns, with the head, the last-position
        logits (B, vocab) float32 (for a `greedy` step the argmax ids (B,) int64) on rank 0 of a
        TP group and None on the others; without the head, the hidden state (B, T, D)."""
        m = self.model
        seqs = step.sequences
        self.check(step)
        lengths = [len(s.token_ids) for s in seqs]
        slots = [self.slots.slot(s.seq_id) for s in seqs]
        ctx = m.context([s.start_pos for s in seqs], lengths, self.cache, slots)
        if m.with_embed:
            T = max(lengths)
            rows = [list(s.token_ids) + [0] * (T - len(s.token_ids)) for s in seqs]
            tokens = torch.tensor(rows, dtype=torch.int64, device=m.device)  # (B, T)
            h = m.embed(tokens)  # (B, T, D)
        else:
            if h_in is None:
                raise ValueError("a stage without the embedding needs the previous hidden state")
            h = h_in.to(device=m.device, dtype=m.dtype)
        h = m.forward_layers(h, ctx)
        for s, n in zip(seqs, lengths):
            self._cached[s.seq_id] = s.start_pos + n
        if not m.with_head:
            return h
        if step.greedy:
            ids = m.head_argmax(m.last_hidden(h, ctx))  # (B, 1) int64 or None off rank 0
            return None if ids is None else ids[:, 0].cpu()
        logits = m.head(m.last_hidden(h, ctx))  # (B, 1, vocab) or None off rank 0
        return None if logits is None else logits[:, 0].float().cpu()

    def check(self, step: Step) -> None:
        """Raises `StepOrderError` for a step this runner (and so every rank) would refuse: the
        head calls it before broadcasting, so a bad step never desynchronizes the group."""
        seqs = step.sequences
        if not seqs:
            raise StepOrderError("a step needs at least one sequence")
        if len({s.seq_id for s in seqs}) != len(seqs):
            raise StepOrderError("a sequence appears twice in one step")
        new = 0
        for s in seqs:
            have = self._cached.get(s.seq_id)
            if have is None:
                new += 1
            if s.start_pos != (have or 0):
                raise StepOrderError(
                    f"sequence {s.seq_id} starts at {s.start_pos} but {have or 0} tokens are cached"
                )
            if not s.token_ids:
                raise StepOrderError(f"sequence {s.seq_id} has no new tokens")
            if s.start_pos + len(s.token_ids) > self.max_seq_len:
                raise StepOrderError(
                    f"sequence {s.seq_id} would reach {s.start_pos + len(s.token_ids)} tokens; "
                    f"the KV cache holds {self.max_seq_len}"
                )
        free = self.max_batch - len(self._cached)
        if new > free:
            raise StepOrderError(f"{new} new sequences but only {free} free KV cache slots")

    def release(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        for sid in seq_ids:
            self.slots.release(sid)
            self._cached.pop(sid, None)
