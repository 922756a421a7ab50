"""Builds the reference model from a model source, reading each tensor once, straight into place.

A `GGUFModel`, a `QuantizedModelDir` (a safetensors model quantized in memory) or an
`Mxfp4ModelDir` (gpt-oss's MXFP4 experts) goes to `gguf.load.load_gguf_model` (quantized weights
stay in their blocks); a safetensors `ModelDir` is read here.

The model is first built on the `meta` device (no memory), then each parameter is read from the
memory-mapped checkpoint, converted to the compute dtype and assigned, so peak memory is the model
plus one tensor. A pipeline stage passes `layer_range` / `with_embed` / `with_head` and reads only
its own layers.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.loaders.gguf.load import load_gguf_model
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.quantized_dir import QuantizedModelDir
from tandem.loaders.mxfp4_dir import Mxfp4ModelDir
from tandem.loaders.safetensors_dir import FLOAT_CODES, ModelDir, TensorDtypeError, TensorShapeError
from tandem.models.llama import Transformer
from tandem.models.skeleton import skeleton


def check_tensor(md: ModelDir, name: str, shape: tuple[int, ...]) -> None:
    """Raises the typed error naming file and tensor if `name` is absent, not a float, or misshapen."""
    info = md.info(name)
    if info.dtype not in FLOAT_CODES:
        raise TensorDtypeError(
            f"{info.file}: tensor {name!r} is {info.dtype}; weights must be one of {', '.join(FLOAT_CODES)}"
        )
    if info.shape != tuple(shape):
        raise TensorShapeError(
            f"{info.file}: tensor {name!r} has shape {list(info.shape)}, the config implies {list(shape)}"
        )


def load_model(
    md: ModelDir | GGUFModel | QuantizedModelDir | Mxfp4ModelDir,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layer_range: tuple[int, int] | None = None,
    with_embed: bool = True,
    with_head: bool = True,
) -> Transformer:
    if isinstance(md, (GGUFModel, QuantizedModelDir, Mxfp4ModelDir)):
        return load_gguf_model(
            md,
            dtype=dtype,
            device=device,
            layer_range=layer_range,
            with_embed=with_embed,
            with_head=with_head,
        )
    with skeleton():
        model = Transformer(md.config, layer_range, with_embed, with_head)
    loaded: dict[str, nn.Parameter] = {}
    for pname, param in list(model.named_parameters(remove_duplicate=False)):
        src = model.checkpoint_name(pname)
        p = loaded.get(src)
        if p is None:
            check_tensor(md, src, tuple(param.shape))
            t = md.read(src).to(device=device, dtype=dtype)
            p = loaded[src] = nn.Parameter(t, requires_grad=False)
        owner, _, leaf = pname.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)
    return model.eval()
