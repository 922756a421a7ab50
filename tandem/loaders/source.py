"""Which kind of model a `--model` path names, opened as a model source.

    a file NAME.gguf (a split part NAME-0000i-of-0000N.gguf: all parts)   -> GGUFModel
    a folder with config.json (the Hugging Face layout)                    -> ModelDir
    a folder without config.json holding exactly one GGUF model            -> GGUFModel

Both sources offer `config`, `manifest` / `info`, `read`, `fingerprint()`, `tokenizer()` and
`close()`, and `loaders.load.load_model` builds the reference model from either. Sharding a GGUF
model's quantized weights across tensor-parallel ranks is not built yet: `require_shardable`
refuses it in one line before any rank starts (pipeline stages, which hold whole layers, load
through `load_model` and work).
"""

from __future__ import annotations

from pathlib import Path

from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.reader import GGUFError
from tandem.loaders.safetensors_dir import ModelDir

ModelSource = ModelDir | GGUFModel


class GGUFShardingUnsupportedError(GGUFError):
    """Tensor parallelism over a GGUF model: its quantized weights cannot be sharded yet."""


def is_gguf(path: str | Path) -> bool:
    """`path` names a GGUF model (a .gguf file, or a folder of one without config.json)."""
    p = Path(path)
    if p.is_dir():
        return not (p / "config.json").exists() and any(p.glob("*.gguf"))
    return p.suffix == ".gguf"


def open_model(path: str | Path) -> ModelSource:
    """The model source at `path` (module docstring); typed errors from either loader."""
    return GGUFModel(path) if is_gguf(path) else ModelDir(path)


def require_shardable(model: str | Path | ModelSource, what: str = "tensor parallelism") -> None:
    """Refuses `what` over a GGUF model (a path or an opened source) with
    GGUFShardingUnsupportedError; a no-op otherwise."""
    gguf = isinstance(model, GGUFModel) or (isinstance(model, (str, Path)) and is_gguf(model))
    if gguf:
        path = model.path if isinstance(model, GGUFModel) else model
        raise GGUFShardingUnsupportedError(
            f"{path}: {what} over a GGUF model is not supported yet (its quantized weights are "
            "not sharded across ranks); run it on one node (--tp 1), or convert it to a "
            "safetensors model directory"
        )
