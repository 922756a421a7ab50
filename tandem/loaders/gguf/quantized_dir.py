"""`QuantizedModelDir`: a safetensors model directory quantized in memory at load (`--quantize`),
a model source that `gguf.load.load_gguf_model` builds exactly as it builds the GGUF file
`tandem quantize` writes from the same directory:

    a matrix   -> the ggml type `tensor_types.tensor_type` gives it (e.g. Q4_K, or F16 where a row is
                  not whole blocks), packed by `models.quant.quantize` into the same blocks as
                  the file's (the `llama` q/k row permutation a file carries, which its loader
                  undoes, commutes with quantizing row by row, so it changes nothing here)
    1-D        -> float32, as the file stores it

so the model runs the same kernels on the same bytes and gives the same logits as the file.
Memory: each matrix is read from the mapped safetensors and converted to float32 (one tensor at
a time) while it is packed; only its blocks are kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.loaders.gguf.names import gguf_name
from tandem.loaders.gguf.quantize_choices import QTYPES
from tandem.loaders.gguf.tensor_types import tensor_type
from tandem.loaders.safetensors_dir import ModelDir, TensorShapeError
from tandem.models.quant.blocks import BY_ID, BY_NAME, QUANTIZED
from tandem.models.quant.quantize import quantize

if TYPE_CHECKING:
    import torch

_FLOAT = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # torch dtype names


class QuantizeChoiceError(ValueError):
    """A --quantize type tandem does not offer, or a model it cannot quantize."""


def writer_qtype(choice: str) -> str:
    """`q4_k` -> the writer's "Q4_K" (typed error naming the choices)."""
    qtype = QTYPES.get(choice.lower())
    if qtype is None:
        raise QuantizeChoiceError(f"quantize type {choice!r}: choose one of {', '.join(QTYPES)}")
    return qtype


@dataclass(frozen=True)
class QuantizedTensorInfo:
    name: str  # the HF parameter name
    type_id: int
    shape: tuple[int, ...]  # (rows, cols), as the model's parameter

    @property
    def dtype(self) -> str:
        return BY_ID[self.type_id].name

    @property
    def quantized(self) -> bool:
        return self.type_id in QUANTIZED


class QuantizedModelDir:
    """`md` with every matrix in ggml type blocks (module docstring); quantized lazily, once."""

    def __init__(self, md: ModelDir, choice: str) -> None:
        self.md = md
        self.choice = choice.lower()
        self.qtype = writer_qtype(choice)
        self.config = md.config
        self.path = md.path
        self.manifest = md.manifest
        self._blocks: dict[str, torch.Tensor] = {}

    def info(self, name: str) -> QuantizedTensorInfo:
        shape = tuple(self.md.info(name).shape)
        g = gguf_name(name, self.config.family.gguf_names)
        kind = tensor_type(g, shape, self.qtype, self.config.tie_word_embeddings)
        return QuantizedTensorInfo(name, BY_NAME[kind].type_id, shape)

    def check(self, name: str, shape: tuple[int, ...]) -> QuantizedTensorInfo:
        info = self.info(name)
        if info.shape != tuple(shape):
            raise TensorShapeError(
                f"{self.md.info(name).file}: tensor {name!r} has shape {list(info.shape)}, the "
                f"config implies {list(shape)}"
            )
        return info

    def blocks(self, name: str) -> torch.Tensor:
        """Matrix `name` as uint8 blocks (rows, row_bytes) of its type."""
        q = self._blocks.get(name)
        if q is None:
            info = self.info(name)
            import torch

            x = self.md.read(name).float().numpy()  # (rows, cols)
            q = self._blocks[name] = torch.from_numpy(quantize(x, info.type_id))
        return q

    def read(self, name: str) -> torch.Tensor:
        """`name` as the file would hold it: float32 / float16 values, or its blocks dequantized."""
        import torch

        from tandem.models.quant.dequant import dequantize

        info = self.info(name)
        if info.quantized:
            return dequantize(self.blocks(name), info.type_id).view(info.shape)
        return self.md.read(name).float().to(getattr(torch, _FLOAT[info.dtype]))

    def fingerprint(self) -> str:
        """The directory's fingerprint folded with the quantize type."""
        return hashlib.sha256(f"{self.md.fingerprint()}|{self.qtype}".encode()).hexdigest()

    def weight_format(self) -> str:
        return f"{self.md.weight_format()} quantized to {self.choice.upper()}"

    def tokenizer(self):
        return self.md.tokenizer()

    def close(self) -> None:
        self._blocks.clear()
        self.md.close()
