"""Builds the reference model from a `GGUFModel`, quantized weights kept in their blocks (or
from a `QuantizedModelDir`, a safetensors model quantized in memory, or an `Mxfp4ModelDir`,
gpt-oss's MXFP4 experts in safetensors, which offer the same `check` / `blocks` / `read`).

The `Transformer` is built on the `meta` device, then filled module by module:

    a linear layer or the embedding whose tensor is quantized  -> QuantLinear / QuantEmbedding over
        the tensor's blocks (a view of the mapped file: no dequantized copy, no copy at all unless
        the device is not the CPU or the rows were permuted, see `model_file`)
    a tied LM head over a quantized embedding                   -> a QuantLinear sharing the
        embedding's `qweight`
    an MoE layer's stacked experts whose tensor is quantized    -> QuantExpertLinear over the
        (E, rows, row_bytes) blocks
    everything else (norms, biases, F32/F16/BF16 weights)       -> dense parameters in the
        compute dtype, as `loaders.load` does for safetensors

Every tensor is checked before it is used: present, of a type tandem reads, of the shape the
metadata implies (typed errors naming the file and tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.quantized_dir import QuantizedModelDir
from tandem.loaders.mxfp4_dir import Mxfp4ModelDir
from tandem.models.llama import Transformer
from tandem.models.moe import ExpertLinear
from tandem.models.quant.linear import QuantEmbedding, QuantExpertLinear, QuantLinear
from tandem.models.skeleton import skeleton


def load_gguf_model(
    src: GGUFModel | QuantizedModelDir | Mxfp4ModelDir,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layer_range: tuple[int, int] | None = None,
    with_embed: bool = True,
    with_head: bool = True,
) -> Transformer:
    with skeleton():
        model = Transformer(src.config, layer_range, with_embed, with_head)
    blocks: dict[str, torch.Tensor] = {}  # checkpoint name -> its blocks on `device` (tied: once)

    def dense(name: str, shape: tuple[int, ...]) -> nn.Parameter:
        src.check(name, shape)
        t = src.read(name).reshape(shape)  # a file may drop size-1 dims (`check`)
        return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

    for mname, mod in list(model.named_modules()):
        if isinstance(mod, ExpertLinear):
            info = src.check(mname + ".weight", tuple(mod.weight.shape))
            if info.quantized:
                q = src.blocks(mname + ".weight").to(device)
                e, rows, cols = info.shape
                bias = None if mod.bias is None else dense(mname + ".bias", tuple(mod.bias.shape))
                owner, _, leaf = mname.rpartition(".")
                setattr(
                    model.get_submodule(owner),
                    leaf,
                    QuantExpertLinear(info.type_id, e, cols, rows, q, bias),
                )
            continue
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        source = model.checkpoint_name(mname + ".weight")
        info = src.check(source, tuple(mod.weight.shape))
        if not info.quantized:
            continue
        q = blocks.get(source)
        if q is None:
            q = blocks[source] = src.blocks(source).to(device)
        rows, cols = info.shape
        if isinstance(mod, nn.Embedding):
            new: nn.Module = QuantEmbedding(info.type_id, rows, cols, q, dtype)
        else:
            bias = None
            if mod.bias is not None:
                bias = dense(mname + ".bias", tuple(mod.bias.shape))
            new = QuantLinear(info.type_id, cols, rows, q, bias)
        owner, _, leaf = mname.rpartition(".")
        setattr(model.get_submodule(owner), leaf, new)

    loaded: dict[str, nn.Parameter] = {}
    for pname, param in list(model.named_parameters(remove_duplicate=False)):
        if param.device.type != "meta":
            continue  # a quantized module's bias, already loaded
        source = model.checkpoint_name(pname)
        p = loaded.get(source)
        if p is None:
            p = loaded[source] = dense(source, tuple(param.shape))
        owner, _, leaf = pname.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)
    return model.eval()
