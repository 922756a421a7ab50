"""Megatron-style tensor-parallel layers. Each holds only its rank's shard; the communicator is passed
explicitly and every collective is called in plain sight in `forward` (no hooks, no globals).

Notation: `X` is the input (..., in), a linear layer computes `Y = X A^T + b` with `A` of shape
(out, in) as `nn.Linear` stores it, and rank r of p owns a half-open `Span` `[start, end)` of one dimension (`parallel.apportion`).
Every product goes through `tandem.kernels.linear.linear`, the single-node model's kernel (the
native row kernel at any row count on a CPU with the native build, else oneDNN for float32 on x86
CPUs, `F.linear` elsewhere), so a shard multiplies as the monolith does.

A layer built with `qtype` (a GGUF block type) holds no dense weight: its shard stays in the
file's blocks as `quant` (a `QuantLinear` / `QuantEmbedding` over the rank's blocks only, filled
by `shard_load`), and it multiplies through whatever `quant` is, as the single-node GGUF model
does: the reference module (dequantize in the input's dtype, `F.linear`), or, once
`tandem.kernels.prepare` has swapped it in place, the native `QuantKernelLinear` over the same
blocks. A column shard is a row slice of whole blocks; a row-parallel shard's columns start and
end on block boundaries (the plan guarantees it). A column-parallel layer's bias is its `quant`
module's own (one parameter, two names), so the native kernel adds it as the monolith's does.

On the native kernels (x quantized to int8 per block of 32, csrc/qgemv.c) a shard computes:

    column-parallel  rows [a, b) of the monolith's output, bit for bit: every output row is its
                     own dot product over the full contraction, on the same int8 activations
    row-parallel     sum_r (X_r A_r^T): the edges fall on multiples of 32, so each rank's int8
                     activations are the monolith's (per-block scales); the per-block int32 dots
                     are the monolith's; only the float32 order of summing the block products
                     differs (within each rank, then across ranks in the all-reduce)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.comm.base import Communicator
from tandem.kernels.linear import linear
from tandem.models.quant.blocks import layout
from tandem.models.quant.linear import QuantEmbedding, QuantLinear


def _placeholder(qtype: int, rows: int, cols: int) -> torch.Tensor:
    """Meta uint8 blocks (rows, row_bytes(cols)) that `shard_load` replaces with the file's."""
    return torch.empty((rows, layout(qtype).row_bytes(cols)), dtype=torch.uint8, device="meta")


def _quant_linear(q: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`q(x) (+ b)` in x.dtype, `q` the reference `QuantLinear` (bias inside its F.linear, as
    `QuantLinear.forward` adds its own) or the native kernel prepare swapped in (bias after)."""
    if bias is None:
        return q(x)
    if isinstance(q, QuantLinear):
        return F.linear(x, q.dequantized(x.dtype), bias.to(x.dtype))
    y = q(x)
    return y + bias.to(y.dtype)


@dataclass(frozen=True)
class GatheredInput:
    """o_proj's "gather" split (`TPPlan.o_split`): this rank's input is columns `[x_start,
    x_end)` of the full (..., total) activation, and it contracts columns `[c_start, c_end)`."""

    x_start: int
    x_end: int
    total: int
    c_start: int
    c_end: int


class ColumnParallelLinear(nn.Module):
    """`Y = X A^T + b` with `A` split along its output features (the rows of the stored weight):

        A = [A_1; ...; A_p],  b = [b_1, ..., b_p],  rank r computes Y_r = X A_r^T + b_r

    so the output stays sharded along its last dimension, `Y = [Y_1, ..., Y_p]`. No communication:
    the consumer is a `RowParallelLinear` (or attention over this rank's heads) that takes `Y_r`.
    Each output element is computed by exactly one rank over the full contraction (no reassociation
    across ranks; equal to the monolith up to how the GEMM kernel blocks a narrower output).
    """

    def __init__(
        self,
        in_features: int,
        out_local: int,
        bias: bool,
        *,
        qtype: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_local
        self.quant = None
        self.bias = (
            nn.Parameter(torch.empty(out_local, device=device, dtype=dtype)) if bias else None
        )
        if qtype is None:
            self.weight = nn.Parameter(
                torch.empty(out_local, in_features, device=device, dtype=dtype)
            )
        else:
            self.weight = None
            blocks = _placeholder(qtype, out_local, in_features)
            self.quant = QuantLinear(qtype, in_features, out_local, blocks, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> (..., out_local)
        if self.quant is not None:
            return self.quant(x)  # its bias is self.bias
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`Y = X A^T + b` with `A` split along its input features (the columns of the stored weight)
    and `X` split to match (it arrives sharded from a `ColumnParallelLinear`):

        A = [A_1, ..., A_p],  X = [X_1, ..., X_p],  Y = sum_r X_r A_r^T + b

    Rank r computes the partial `X_r A_r^T`; `comm.all_reduce_sum` adds the partials (bit-identical
    on every rank); the bias is added once, after the sum, on every rank.
    """

    def __init__(
        self,
        in_local: int,
        out_features: int,
        bias: bool,
        comm: Communicator,
        *,
        qtype: int | None = None,
        gather: GatheredInput | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.comm = comm
        self.in_features = in_local
        self.out_features = out_features
        self.gather = gather
        self.quant = None
        if qtype is None:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_local, device=device, dtype=dtype)
            )
        else:
            self.weight = None
            self.quant = QuantLinear(
                qtype, in_local, out_features, _placeholder(qtype, out_features, in_local)
            )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return _quant_linear(self.quant, x, bias)
        return linear(x, self.weight, bias)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """The "gather" fallback's input: every rank writes its columns into a zero (..., total)
        tensor and the all-reduce sums them (x + 0 = x exactly: an all-gather of unequal parts),
        then this rank keeps its block-aligned contraction columns."""
        g = self.gather
        full = x.new_zeros((*x.shape[:-1], g.total))  # (..., H*hd)
        full[..., g.x_start : g.x_end] = x
        full = self.comm.all_reduce_sum(full)
        return full[..., g.c_start : g.c_end].contiguous()  # (..., in_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self._matmul(x, self.bias)  # the monolith's kernel
        if self.gather is not None:
            x = self._gathered(x)
        partial = self._matmul(x, None)  # (..., in_local) -> (..., out)
        y = self.comm.all_reduce_sum(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding table `E` (vocab, dim) split along the vocabulary: rank r holds rows
    `[v_start, v_end)`. A token id in range looks up its row; out-of-range ids give zero rows:

        h = sum_r onehot(ids)[:, v_start_r : v_end_r] E_r

    and `comm.all_reduce_sum` adds the p partials. Exactly one rank contributes each row and the
    others add exact zeros, so the result is bit-identical to the unsharded lookup.
    """

    def __init__(
        self,
        vocab_start: int,
        vocab_end: int,
        dim: int,
        comm: Communicator,
        *,
        qtype: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.comm = comm
        self.vocab_start = vocab_start
        self.vocab_end = vocab_end
        self.embedding_dim = dim
        rows = vocab_end - vocab_start
        self.quant = None
        if qtype is None:
            self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype))
        else:
            self.weight = None
            self.quant = QuantEmbedding(
                qtype, rows, dim, _placeholder(qtype, rows, dim), dtype or torch.float32
            )

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.quant is None else self.quant(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = self._lookup(local)  # (B, T) -> (B, T, dim)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce_sum(rows)


class VocabParallelLMHead(nn.Module):
    """The LM head `logits = h W^T` with `W` (vocab, dim) split along the vocabulary: rank r holds
    rows `[v_start, v_end)` (for tied embeddings, the same shard as `VocabParallelEmbedding`) and
    computes the logits of its slice of the vocabulary (in float32 once gathered, TP > 1):

        logits = [h W_1^T, ..., h W_p^T]

    The slices go to the head only: `comm.all_to_all` sends rank r's slice to rank 0 and nothing
    elsewhere, and rank 0 concatenates them in rank order. Other ranks return `None`. Each logit is
    computed by exactly one rank over the full hidden dimension (no cross-rank reassociation).
    """

    def __init__(
        self,
        vocab_start: int,
        vocab_end: int,
        dim: int,
        comm: Communicator,
        *,
        weight: nn.Parameter | None = None,
        qtype: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.comm = comm
        self.vocab_start = vocab_start
        self.vocab_end = vocab_end
        self.quant = None
        if qtype is not None:
            rows = vocab_end - vocab_start
            self.quant = QuantLinear(qtype, dim, rows, _placeholder(qtype, rows, dim))
            weight = None
        elif weight is None:
            weight = nn.Parameter(
                torch.empty(vocab_end - vocab_start, dim, device=device, dtype=dtype)
            )
        self.weight = weight

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # (..., dim) -> (..., v_local)
        if self.quant is not None:
            return _quant_linear(self.quant, h, None)
        return linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor | None:
        local = self._logits(h)  # (..., dim) -> (..., v_local)
        if self.comm.world_size == 1:
            return local
        # float32 travels the (float32) wire losslessly whatever each rank computes in, so a
        # float16 rank's logits do not pass through rank 0's bfloat16 on the way
        return gather_to_head(self.comm, local.float())

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """The argmax token ids of `forward(h)` on rank 0 (None elsewhere), without the logits:
        rank r sends the head, per row, its slice's maximum m_r and global index v_start_r + i_r
        (2 floats instead of v_local), and

            argmax = v_start_s + i_s  for the first rank s with m_s = max_r m_r

        which is `torch.argmax` of the gathered row (first maximal index), since the slices are
        concatenated in rank order. Indices travel exactly: vocab < 2^24 (float32's integers).

        The pairs meet in one small all-reduce rather than a gather: rank r writes its pair into
        slots [2r, 2r+2) of a zero tensor (..., 2p), and since x + 0 = x exactly, the sum is the
        rank-ordered pairs, on the latency-optimal path the layers' all-reduces already take."""
        local = self._logits(h).float()  # (..., dim) -> (..., v_local)
        n, r = self.comm.world_size, self.comm.rank
        if n == 1:
            return local.argmax(-1)
        best, idx = local.max(-1, keepdim=True)  # (..., 1) each; the first maximum in the slice
        slots = local.new_zeros((*local.shape[:-1], 2 * n))  # (..., 2p)
        slots[..., 2 * r] = best[..., 0]
        slots[..., 2 * r + 1] = (idx[..., 0] + self.vocab_start).float()
        pairs = self.comm.all_reduce_sum(slots)  # (..., 2p), the same on every rank
        return pick_argmax(pairs) if r == 0 else None


def pick_argmax(pairs: torch.Tensor) -> torch.Tensor:
    """(..., 2p) rank-ordered (max, global index) pairs -> (...,) int64: the index of the first
    rank holding the overall maximum (`torch.argmax` returns the first of equal maxima)."""
    values, indices = pairs[..., 0::2], pairs[..., 1::2]  # (..., p) each
    winner = values.argmax(-1, keepdim=True)  # first rank holding the maximum
    return indices.gather(-1, winner).squeeze(-1).long()


def gather_to_head(comm: Communicator, local: torch.Tensor) -> torch.Tensor | None:
    """Rank-ordered concatenation of every rank's `local` along the last dim, delivered to rank 0
    only (rank 0 gets the tensor, other ranks `None`). Parts may differ in their last dim."""
    if comm.world_size == 1:
        return local
    empty = local[..., :0]
    parts = [local if j == 0 else empty for j in range(comm.world_size)]
    received = comm.all_to_all(parts)
    if comm.rank != 0:
        return None
    return torch.cat(received, dim=-1)
