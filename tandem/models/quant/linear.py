"""The reference modules over GGUF blocks: plain math that every fast path is proven against.

`QuantLinear` computes `Y = X W^T (+ b)` with W `(out_features, in_features)` stored as ggml
blocks of type `qtype`, row-major: buffer `qweight` is uint8 `(out_features, row_bytes)`, row r
holding W[r, :] as `in_features / block_size` whole blocks. A row-parallel TP shard of it is a
row slice (free); a column shard cuts at multiples of `block_size` elements.

`QuantEmbedding` holds a `(vocab, embedding_dim)` table the same way and dequantizes only the rows
looked up. `QuantExpertLinear` holds E such matrices stacked by expert (a GGUF `ffn_*_exps` tensor,
`qweight` (E, out_features, row_bytes)) and multiplies by one expert's blocks at a time. A tied LM head is a QuantLinear whose `qweight` is the embedding's own tensor (no copy).

`qweight` is a non-persistent buffer (it may be a zero-copy view of the memory-mapped GGUF file, and
it is not a trained parameter); its bytes are never written. The forward passes dequantize to
float32 (`dequant.dequantize`), round once to the input's dtype, then call the library op, so they
are exact dequantize-then-multiply in that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.quant.blocks import layout
from tandem.models.quant.dequant import dequantize


class QuantShapeError(ValueError):
    """Blocks whose shape or dtype disagrees with the module's declared shape and type."""


def _check_blocks(qweight: torch.Tensor, qtype: int, rows: int, cols: int, what: str) -> None:
    t = layout(qtype)
    want = (rows, t.row_bytes(cols))
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
        raise QuantShapeError(
            f"{what}: {t.name} blocks for ({rows}, {cols}) must be uint8 {want}, got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )


class QuantLinear(nn.Module):
    """x (..., in_features) -> (..., out_features) in x.dtype, W kept in its blocks."""

    def __init__(
        self,
        qtype: int,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        _check_blocks(qweight, qtype, out_features, in_features, "QuantLinear")
        self.qtype = int(qtype)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", qweight, persistent=False)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (out_features, in_features) in `dtype` (a new tensor)."""
        return dequantize(self.qweight, self.qtype).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized(x.dtype)  # (out, in)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, qtype={layout(self.qtype).name}, "
            f"bias={self.bias is not None}"
        )


class QuantExpertLinear(nn.Module):
    """`models.moe.ExpertLinear` over blocks: x (N, in) through expert e -> (N, out) in x.dtype,
    only expert e's blocks dequantized; `bias` (E, out) a dense parameter (gpt-oss)."""

    def __init__(
        self,
        qtype: int,
        n_experts: int,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        t = layout(qtype)
        want = (n_experts, out_features, t.row_bytes(in_features))
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise QuantShapeError(
                f"QuantExpertLinear: {t.name} blocks for {n_experts} experts ({out_features}, "
                f"{in_features}) must be uint8 {want}, got {qweight.dtype} {tuple(qweight.shape)}"
            )
        self.qtype = int(qtype)
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.register_buffer("qweight", qweight, persistent=False)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        w = dequantize(self.qweight[e], self.qtype).to(x.dtype)  # (out, in)
        return F.linear(x, w, None if self.bias is None else self.bias[e].to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"experts={self.n_experts}, in={self.in_features}, out={self.out_features}, "
            f"qtype={layout(self.qtype).name}"
        )


class QuantEmbedding(nn.Module):
    """ids (...) int64 -> (..., embedding_dim) in `dtype`; only the looked-up rows are
    dequantized."""

    def __init__(
        self,
        qtype: int,
        num_embeddings: int,
        embedding_dim: int,
        qweight: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        _check_blocks(qweight, qtype, num_embeddings, embedding_dim, "QuantEmbedding")
        self.qtype = int(qtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype
        self.register_buffer("qweight", qweight, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids.reshape(-1)]  # (n, row_bytes): the blocks of those rows only
        out = dequantize(rows, self.qtype).to(self.dtype)  # (n, D)
        return out.view(*ids.shape, self.embedding_dim)

    def tied_head(self) -> QuantLinear:
        """The LM head `logits = h E^T` over this table's own blocks (shared, not copied)."""
        return QuantLinear(self.qtype, self.embedding_dim, self.num_embeddings, self.qweight)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, qtype={layout(self.qtype).name}, "
            f"dtype={self.dtype}"
        )
