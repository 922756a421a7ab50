"""A preallocated key/value cache, keyed by global layer index, one row ("slot") per sequence.

Each layer holds k and v of shape (n_slots, n_kv_heads, max_seq_len, head_dim). `n_kv_heads` is the
count this process actually computes: the full count on one device, the local share under tensor
parallelism. A pipeline stage allocates only the layers it holds. Nothing is allocated per token.

A Gated DeltaNet layer (Qwen3.5's linear layers, `models.deltanet`) holds no keys or values: its
slot holds the sequence's recurrent state instead, of fixed size whatever its length:
`conv[i]` (n_slots, conv channels, K - 1) in the compute dtype and `ssm[i]` (n_slots, Hv, dk, dv)
in float32. Such a state cannot be rewound to an earlier position (`engine.sequences`).

On a CPU the keys and values live in shared pages (`models.kv_pages`): each layer's k and v is a
plane (n_slots, n_kv_heads, S, head_dim), S = max_seq_len rounded up to whole blocks (the tensors
are its first max_seq_len positions, strided: the rest is never touched), and a prefix copy maps the source's whole blocks instead of copying them (`copy_prefix`). On an accelerator,
or where the OS gives no such mapping (logged once), they are plain tensors and copies take bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tandem.models.kv_pages import KVPages, KVPagesUnavailable, warn_unavailable
from tandem.models.slots import CacheFullError, SequenceTooLongError, SlotTable

__all__ = [
    "CacheFullError",
    "CacheWrites",
    "KVCache",
    "SequenceTooLongError",
    "SlotTable",
    "plan_writes",
]


@dataclass
class CacheWrites:
    """Where one step's keys and values go in the cache, and which rows it reads back.

    Row b of the step (B rows, padded to T tokens) lives in cache slot `slots[b]`; its real tokens
    are written at positions `start_pos[b] ..`, and every row reads cache positions 0..kv_len-1.
    Either `block` = (slot a, slot b, pos s0, pos s1): every row valid, one shared start, slots
    a..b-1 in order, so the write is one strided copy; or `write_slots`/`write_pos` (N,) give the
    slot and position of each written token, `write_rows` (N,) its flat B*T index (None: all).
    `slot_range` = (a, b) when the rows' slots are a..b-1 in order (read by slicing)."""

    slots: torch.Tensor  # (B,) int64
    kv_len: int
    slot_range: tuple[int, int] | None = None
    block: tuple[int, int, int, int] | None = None
    write_slots: torch.Tensor | None = None
    write_pos: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None


def plan_writes(
    max_seq_len: int,
    start_pos: Sequence[int],
    lengths: Sequence[int],
    slots: Sequence[int],
    positions: torch.Tensor,
) -> CacheWrites:
    """The `CacheWrites` of a step whose row b holds `lengths[b]` new tokens at `positions[b]`
    (B, T) from `start_pos[b]`, in cache slot `slots[b]`; `SequenceTooLongError` past the cache."""
    B, T = positions.shape
    device = positions.device
    ends = [s + n for s, n in zip(start_pos, lengths)]
    if max(ends) > max_seq_len:
        raise SequenceTooLongError(
            f"a sequence would reach {max(ends)} tokens; the KV cache holds {max_seq_len}"
        )
    w = CacheWrites(torch.tensor(list(slots), dtype=torch.int64, device=device), max(ends))
    all_valid = all(n == T for n in lengths)
    consecutive = list(slots) == list(range(slots[0], slots[0] + B))
    if consecutive:
        w.slot_range = (slots[0], slots[0] + B)
    if consecutive and all_valid and len(set(start_pos)) == 1:
        w.block = (slots[0], slots[0] + B, start_pos[0], start_pos[0] + T)
        return w
    flat_pos = positions.reshape(-1)
    flat_slot = w.slots.repeat_interleave(T)
    if not all_valid:
        rows = [b * T + t for b, n in enumerate(lengths) for t in range(n)]
        w.write_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        flat_pos, flat_slot = flat_pos[w.write_rows], flat_slot[w.write_rows]
    w.write_slots, w.write_pos = flat_slot, flat_pos
    return w


# a recurrent layer's state shape: (conv channels, conv window K - 1, v heads, dk, dv)
RecurrentShape = tuple[int, int, int, int, int]


class KVCache:
    def __init__(
        self,
        layer_ids: Iterable[int],
        n_slots: int,
        max_seq_len: int,
        n_kv_heads: int | dict[int, int],
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        states: dict[int, RecurrentShape] | None = None,
    ) -> None:
        """`states`: the recurrent layers (no keys/values) and their state's shape."""
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for i, (channels, window, heads, dk, dv) in (states or {}).items():
            self.conv[i] = torch.zeros(n_slots, channels, window, dtype=dtype, device=device)
            self.ssm[i] = torch.zeros(n_slots, heads, dk, dv, dtype=torch.float32, device=device)
        attn = [i for i in layer_ids if i not in self.conv]
        heads = {i: n_kv_heads[i] if isinstance(n_kv_heads, dict) else n_kv_heads for i in attn}
        self.pages = _pages(attn, heads, n_slots, max_seq_len, head_dim, dtype, device)
        for n, i in enumerate(attn):
            if self.pages is not None:  # planes 2n, 2n + 1: (slots, G, max_seq_len, hd) views
                self.k[i], self.v[i] = (
                    _view(self.pages, 2 * n + kv, dtype, head_dim)[:, :, :max_seq_len]
                    for kv in (0, 1)
                )  # fmt: skip
                continue
            shape = (n_slots, heads[i], max_seq_len, head_dim)
            self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[i] = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(
        cls, model: nn.Module, n_slots: int, max_seq_len: int, dtype: torch.dtype | None = None
    ) -> KVCache:
        """Sizes the cache from the layers `model` holds, reading each attention's own (possibly
        tensor-parallel local) `n_kv_heads` and `head_dim`."""
        layers = model.model.layers
        states: dict[int, RecurrentShape] = {}
        heads: dict[int, int] = {}
        head_dim = 0
        for i, layer in layers.items():
            net = getattr(layer, "linear_attn", None) if getattr(layer, "linear", False) else None
            if net is not None:
                states[int(i)] = (
                    net.conv_channels, net.kernel - 1, net.n_v_heads, net.dk, net.dv
                )  # fmt: skip
            else:
                heads[int(i)] = layer.self_attn.n_kv_heads
                head_dim = layer.self_attn.head_dim
        param = next(model.parameters())
        return cls(
            heads.keys(),
            n_slots,
            max_seq_len,
            heads,
            head_dim,
            dtype or param.dtype,
            param.device,
            states,
        )

    def nbytes(self) -> int:
        """Bytes of every layer's keys, values and recurrent states."""
        held = (*self.k.values(), *self.v.values(), *self.conv.values(), *self.ssm.values())
        return sum(t.numel() * t.element_size() for t in held)

    def bytes_per_sequence(self) -> dict[str, int]:
        """What one slot holds: `kv` (keys and values at max_seq_len) and `state` (recurrent)."""
        kv = sum(t[0].numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
        rec = sum(
            t[0].numel() * t.element_size() for t in (*self.conv.values(), *self.ssm.values())
        )
        return {"kv": kv, "state": rec}

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` takes slot `src`'s first `n` positions of every layer's keys and values,
        k[i][dst, :, :n] = k[i][src, :, :n] (n_kv_heads, n, head_dim), and every recurrent
        layer's whole state (conv window and ssm state: the caller has checked that `n` is all
        the source holds, `SequenceCache.check_copy`). Positions >= n of `dst` are left as they
        were: a step writes them before any row reads them. With `pages`, the whole blocks of
        positions 0..m-1 are the source's pages mapped (`KVPages.share`), m..n-1 copied."""
        m = self.pages.share(src, dst, n) if self.pages is not None else 0
        for i in self.k:
            self.k[i][dst, :, m:n].copy_(self.k[i][src, :, m:n])
            self.v[i][dst, :, m:n].copy_(self.v[i][src, :, m:n])
        for i in self.conv:
            self.conv[i][dst].copy_(self.conv[i][src])
            self.ssm[i][dst].copy_(self.ssm[i][src])

    def update(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, w: CacheWrites
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes this step's keys/values as `w` plans, returns every key/value the batch attends to.

        k_new, v_new: (B, T, n_kv_heads, head_dim) -> returns two (B, n_kv_heads, S, head_dim),
        S = w.kv_len. Rows of padded tokens are not written.
        """
        k_all, v_all = self.k[layer], self.v[layer]
        if w.block is not None:
            # every row valid, one shared start position, consecutive slots: a strided copy
            a, b, s0, s1 = w.block
            k_all[a:b, :, s0:s1].copy_(k_new.transpose(1, 2))
            v_all[a:b, :, s0:s1].copy_(v_new.transpose(1, 2))
        else:
            idx = (w.write_slots, slice(None), w.write_pos)
            B, T = k_new.shape[:2]
            k_rows = k_new.reshape(B * T, *k_new.shape[2:])  # (B*T, n_kv_heads, head_dim)
            v_rows = v_new.reshape(B * T, *v_new.shape[2:])
            if w.write_rows is not None:
                k_rows, v_rows = k_rows[w.write_rows], v_rows[w.write_rows]
            k_all[idx] = k_rows
            v_all[idx] = v_rows
        S = w.kv_len
        if w.slot_range is not None:
            a, b = w.slot_range
            return k_all[a:b, :, :S], v_all[a:b, :, :S]
        return k_all[:, :, :S].index_select(0, w.slots), v_all[:, :, :S].index_select(0, w.slots)


def _pages(
    layers: list[int], heads: dict[int, int], slots: int, max_seq_len: int, head_dim: int,
    dtype: torch.dtype, device: torch.device | str,
) -> KVPages | None:  # fmt: skip
    """Shared pages for the attention layers' keys and values (k, v planes per layer in
    order), or None: an accelerator's memory, no such layer, or the OS gives none."""
    if torch.device(device).type != "cpu" or not layers:
        return None
    es = torch.empty((), dtype=dtype).element_size()
    try:
        return KVPages(
            [heads[i] for i in layers for _ in (0, 1)], slots, max_seq_len, head_dim * es
        )
    except KVPagesUnavailable as e:
        warn_unavailable(str(e))
        return None


def _view(pages: KVPages, plane: int, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """Plane `plane` as a (slots, G, S, head_dim) tensor over the shared pages (no copy)."""
    raw = pages.array(plane, 1, np.uint8, head_dim * torch.empty((), dtype=dtype).element_size())
    return torch.from_numpy(raw[0]).view(dtype)  # (slots, G, S, hd * es) bytes -> dtype
