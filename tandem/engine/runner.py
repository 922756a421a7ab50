"""Runs one `Step` through the part of the model this process holds, with its own KV cache.

The same object serves every layout: a single device (the whole model: `LocalExecutor`), a
tensor-parallel rank (a `shard_transformer` model whose collectives run inside its layers), or a
pipeline stage (a layer range, with or without the embedding and the head: `StageRunner` is its
face for frames that carry rows instead of a `Step`). Each rank of a group runs the same steps in
the same order, so each assigns the same cache slots; nothing here talks to other ranks except
through the model's own layers. Which steps it takes is `SequenceCache`'s one rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.executor import Step
from tandem.engine.sequences import SequenceCache, SequenceError
from tandem.kernels.modules import swap_fast_modules
from tandem.models.kv_cache import KVCache
from tandem.models.llama import Transformer

# the one error under the name the TP runner has always raised
StepOrderError = SequenceError


class ShardRunner:
    """`forward` runs a `Step` (from the tokens, or from the previous stage's hidden state);
    `forward_rows` runs the held layers over a hidden state given as rows. `swap`: give the
    model its fast modules here (False: the caller has prepared it, `tandem.kernels.prepare`)."""

    def __init__(
        self,
        model: Transformer,
        max_batch: int,
        max_seq_len: int,
        *,
        swap: bool = True,
        owner: str = "the KV cache",
    ) -> None:
        if swap:
            swap_fast_modules(
                model
            )  # the native norms, RoPE and attention; TP layers pick their own
        self.model = model
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.seqs = SequenceCache.for_model(model, max_batch, max_seq_len, owner=owner)

    @property
    def cache(self) -> KVCache | None:
        """The KV cache of the layers held (None: no layers)."""
        return self.seqs.kv

    @property
    def live_sequences(self) -> int:
        return len(self.seqs)

    def check(self, step: Step) -> None:
        """Raises `SequenceError` for a step this runner (and so every rank) would refuse: the
        head calls it before broadcasting, so a bad step never desynchronizes the group."""
        self.seqs.check(step)

    @torch.inference_mode()
    def forward(self, step: Step, h_in: torch.Tensor | None = None) -> torch.Tensor | None:
        """With the embedding, `h_in` is None and the tokens come from `step`; otherwise `h_in` is
        the previous stage's hidden state (B, T, D). Returns, with the head, the last-position
        logits (B, vocab) float32 (for a `greedy` step the argmax ids (B,) int64) on rank 0 of a
        TP group and None on the others; without the head, the hidden state (B, T, D)."""
        m = self.model
        seqs = step.sequences
        slots = self.seqs.check(step)
        lengths = [len(s.token_ids) for s in seqs]
        ctx = m.context([s.start_pos for s in seqs], lengths, self.seqs.kv, slots)
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
        self.seqs.advance(step)
        if not m.with_head:
            return h
        if step.greedy:
            ids = m.head_argmax(m.last_hidden(h, ctx))  # (B, 1) int64 or None off rank 0
            return None if ids is None else ids[:, 0].cpu()
        logits = m.head(m.last_hidden(h, ctx))  # (B, 1, vocab) or None off rank 0
        return None if logits is None else logits[:, 0].float().cpu()

    @torch.inference_mode()
    def forward_rows(
        self,
        seq_ids: Sequence[int],
        start_pos: Sequence[int],
        lengths: Sequence[int],
        h: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """The held layers only: h (B, T, D) -> (B, T, D), or (B, 1, D) at each row's last real
        token when `last_only`; row b is sequence `seq_ids[b]`'s `lengths[b]` new tokens from
        `start_pos[b]`."""
        slots = self.seqs.check_rows(seq_ids, start_pos, lengths)
        ctx = self.model.context(start_pos, lengths, self.seqs.kv, slots)
        h = self.model.forward_layers(h.to(self.model.dtype), ctx)
        self.seqs.advance_rows(seq_ids, start_pos, lengths)
        return self.model.last_hidden(h, ctx) if last_only else h

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """New sequence `dst` holds `src`'s first `n` positions of the layers held (this
        process's KV heads, its shard under TP); `PrefixCopyError` for a copy the rule refuses
        (`SequenceCache.check_copy`), before anything changes."""
        self.seqs.copy(src, dst, n)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.seqs.release(seq_ids)
