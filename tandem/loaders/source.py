"""Which kind of model a `--model` path names, opened as a model source.

    a file NAME.gguf (a split part NAME-0000i-of-0000N.gguf: all parts)   -> GGUFModel
    a folder with config.json (the Hugging Face layout)                    -> ModelDir
    the same whose config.json states quant_method "mxfp4" (gpt-oss)       -> Mxfp4ModelDir
    a folder without config.json holding exactly one GGUF model            -> GGUFModel
    a folder with config.json and `quantize` ("q8_0", "q4_0", "q4_k", ...)  -> QuantizedModelDir

Both sources offer `config`, `manifest` / `info`, `read`, `fingerprint()`, `tokenizer()` and
`close()`, and `loaders.load.load_model` builds the reference model from either. Tensor-parallel
ranks shard a GGUF model's quantized weights on block boundaries (`parallel.plan`,
`parallel.shard_load`).
"""

from __future__ import annotations

from pathlib import Path

from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.quantized_dir import QuantizeChoiceError, QuantizedModelDir
from tandem.loaders.mxfp4_dir import Mxfp4ModelDir
from tandem.loaders.safetensors_dir import ModelDir

ModelSource = ModelDir | GGUFModel | QuantizedModelDir | Mxfp4ModelDir


def is_gguf(path: str | Path) -> bool:
    """`path` names a GGUF model (a .gguf file, or a folder of one without config.json)."""
    p = Path(path)
    if p.is_dir():
        return not (p / "config.json").exists() and any(p.glob("*.gguf"))
    return p.suffix == ".gguf"


def open_model(path: str | Path, quantize: str | None = None) -> ModelSource:
    """The model source at `path` (module docstring); typed errors from either loader.
    `quantize` quantizes a safetensors model's matrices in memory as it loads."""
    if is_gguf(path):
        if quantize:
            raise QuantizeChoiceError(
                f"{path}: --quantize applies to safetensors models; a GGUF file keeps its own types"
            )
        return GGUFModel(path)
    md = ModelDir(path)
    if md.config.quant_method == "mxfp4":
        if quantize:
            raise QuantizeChoiceError(
                f"{path}: --quantize applies to float checkpoints; this one's experts are MXFP4"
            )
        return Mxfp4ModelDir(md)
    return QuantizedModelDir(md, quantize) if quantize else md
