"""The ggml type each GGUF tensor is written in, for one `qtype` ("Q8_0", "Q4_K", "F16", ...) or
the mix "K_MIX" (Q4_K, with Q5_K for attn_output / ffn_down (experts' too) and Q6_K for attn_v and
the output matrix: the shape of a Q4_K_M file). An MoE router stays F32, as llama-quantize keeps it. A matrix whose row is not whole blocks falls back as llama.cpp
does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, 32-element types -> F16). No torch: the quantize
choice of a model source is checked before anything is read."""

from __future__ import annotations

from tandem.loaders.gguf.quantize_choices import K_MIX as K_MIX  # the mix's name, defined there
from tandem.models.quant.blocks import BY_NAME

_MIX = {
    "attn_v": "Q6_K",
    "attn_qkv": "Q5_K",  # llama-quantize's Q4_K_M choice for a fused q/k/v
    "output": "Q6_K",
    "attn_output": "Q5_K",
    "ffn_down": "Q5_K",
    "ffn_down_exps": "Q5_K",
    "ffn_down_shexp": "Q5_K",
}
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # kept F32 as llama-quantize keeps them
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


class GGUFWriteError(ValueError):
    """A model the writer cannot express as GGUF (architecture, type or shape)."""


def tensor_type(name: str, shape: tuple[int, ...], qtype: str, tied: bool) -> str:
    """The ggml type name GGUF tensor `name` of `shape` is written in."""
    if len(shape) == 1 or name.endswith(".bias"):  # gpt-oss's expert biases are (E, out)
        return "F32"
    role = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if role in ROUTERS:
        return "F32"
    kind = qtype
    if qtype == K_MIX:
        kind = _MIX.get(role, "Q4_K")
        if role == "token_embd" and tied:
            kind = "Q6_K"
    if kind not in BY_NAME:
        raise GGUFWriteError(f"unknown ggml type {kind!r}; choose one of {', '.join(BY_NAME)}")
    while shape[-1] % BY_NAME[kind].block_size:
        kind = _FALLBACK.get(kind, "F16")
    return kind
