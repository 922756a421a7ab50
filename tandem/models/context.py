"""Per-step forward context: everything every layer needs that depends only on the step.

Built once per step (not per layer): positions, RoPE cos/sin, the attention mask, and where in the
KV cache this step's keys are written and read. A batch row b holds `lengths[b]` new tokens at
absolute positions `start_pos[b] .. start_pos[b] + lengths[b] - 1`, left-aligned and padded to
T = max(lengths); padded tokens are computed but never written to the cache or read out.

A model whose sliding window covers only some layers (gpt-oss) gets two masks: `attn_mask` /
`is_causal` for its full layers and `local_mask` for its windowed ones (`ForwardContext.mask`); a
model windowed throughout (Mistral) folds the window into `attn_mask`. A model whose windowed
layers rotate by a rope table of their own (Gemma 3) gets it as `local_cos` / `local_sin`
(`ForwardContext.rotary`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.models.kv_cache import CacheWrites, KVCache, plan_writes
from tandem.models.rope import RotaryEmbedding


class BadStepError(ValueError):
    """A step whose lengths, positions or slots do not fit together."""


@dataclass
class ForwardContext:
    positions: torch.Tensor  # (B, T) int64 absolute positions
    cos: torch.Tensor  # (B, T, 1, rotary_dim), compute dtype (rotary_dim = head_dim unless partial)
    sin: torch.Tensor
    attn_mask: (
        torch.Tensor | None
    )  # (B, 1, T, S) bool, True = attend; None with is_causal or no mask
    is_causal: bool  # queries and keys are the same T positions from 0: plain causal attention
    kv_len: int  # S: keys each query row may see (cache rows 0..S-1, or the T new tokens)
    last_index: torch.Tensor  # (B,) index in T of each row's last real token
    lengths: tuple[int, ...]
    cache: KVCache | None = None
    writes: CacheWrites | None = None  # where this step's keys/values go (kv_cache.plan_writes)
    local_mask: torch.Tensor | None = None  # (B, 1, T, S) for the windowed layers, when it matters
    start_pos: tuple[int, ...] = ()  # each row's first position (positions[:, 0], on the host)
    local_cos: torch.Tensor | None = None  # (B, T, 1, head_dim): the local rope table's, if any
    local_sin: torch.Tensor | None = None

    def rotary(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for a layer of the local rope table (`local`) or the global one."""
        if local and self.local_cos is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    def mask(self, windowed: bool) -> tuple[torch.Tensor | None, bool]:
        """(attention mask, is_causal) for a layer with (`windowed`) or without a sliding window."""
        if windowed and self.local_mask is not None:
            return self.local_mask, False
        return self.attn_mask, self.is_causal

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def write_block(self) -> tuple[int, int, int, int] | None:
        """(slot a, slot b, pos s0, pos s1) when the step's writes are one strided copy."""
        return None if self.writes is None else self.writes.block


def build_context(
    rope: RotaryEmbedding,
    start_pos: Sequence[int],
    lengths: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    cache: KVCache | None = None,
    slots: Sequence[int] | None = None,
    sliding_window: int | None = None,
    window_everywhere: bool = True,
) -> ForwardContext:
    """See the module docstring. Without a cache, attention sees only this step's tokens.
    `sliding_window` applies to every layer when `window_everywhere`, else to the layers that
    ask for it (`local_mask`)."""
    B = len(lengths)
    if B == 0 or len(start_pos) != B or (slots is not None and len(slots) != B):
        raise BadStepError(f"step with {B} rows, {len(start_pos)} start positions, slots {slots}")
    if min(lengths) < 1 or min(start_pos) < 0:
        raise BadStepError(f"lengths must be >= 1 and positions >= 0: {lengths}, {start_pos}")
    T = max(lengths)
    device = torch.device(device)
    starts = torch.tensor(list(start_pos), dtype=torch.int64, device=device)
    positions = starts[:, None] + torch.arange(T, device=device)  # (B, T)
    ends = [s + n for s, n in zip(start_pos, lengths)]
    cos, sin = rope(positions, dtype, ends)
    all_valid = all(n == T for n in lengths)
    last_index = torch.tensor([n - 1 for n in lengths], dtype=torch.int64, device=device)
    ctx = ForwardContext(positions, cos, sin, None, False, T, last_index, tuple(lengths))
    ctx.start_pos = tuple(start_pos)
    if rope.local_inv_freq is not None:
        ctx.local_cos, ctx.local_sin = rope(positions, dtype, local=True)

    if cache is None:
        key_pos = positions  # keys are this step's tokens
        key_valid = (
            torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        )
        plain_causal = all_valid and all(s == 0 for s in start_pos)
    else:
        if slots is None:
            raise BadStepError("a cached step needs a slot per row")
        writes = plan_writes(cache.max_seq_len, start_pos, lengths, slots, positions)
        if len(set(slots)) != B or min(slots) < 0 or max(slots) >= cache.n_slots:
            raise BadStepError(f"slots {list(slots)} must be distinct and in [0, {cache.n_slots})")
        ctx.cache, ctx.writes = cache, writes
        ctx.kv_len = S = writes.kv_len
        key_pos = torch.arange(S, device=device)[None, :].expand(B, S)
        key_valid = None  # keys past a row's end are only seen by that row's padded queries
        plain_causal = all_valid and all(s == 0 for s in start_pos)

    window_matters = sliding_window is not None and max(ends) > sliding_window
    q = positions[:, :, None]  # (B, T, 1)
    k = key_pos[:, None, :]  # (B, 1, S)
    if window_matters and not window_everywhere:
        local = (k <= q) & (q - k < sliding_window)
        if key_valid is not None:
            local = local & key_valid[:, None, :]
        ctx.local_mask = local[:, None]  # (B, 1, T, S)
        window_matters = False
    if plain_causal and not window_matters:
        ctx.is_causal = T > 1
        return ctx
    if cache is not None and T == 1 and len(set(ends)) == 1 and not window_matters:
        return ctx  # decode with equal lengths: every cached key is visible
    mask = k <= q
    if key_valid is not None:
        mask = mask & key_valid[:, None, :]
    if window_matters:
        mask = mask & (q - k < sliding_window)
    ctx.attn_mask = mask[:, None]  # (B, 1, T, S)
    return ctx
