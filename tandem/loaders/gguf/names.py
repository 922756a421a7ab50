"""GGUF tensor names <-> the model's module names (Hugging Face state-dict keys), in one table,
and llama.cpp's q/k row permutation.

llama.cpp's `convert_hf_to_gguf.py` reorders the rows of q_proj and k_proj (weights and biases)
of `llama`-architecture models, per head, from HF's rotate-half RoPE layout to its interleaved
one: within a head of `hd` rows, GGUF row `2i + j` holds HF row `j * hd/2 + i` (i < hd/2,
j in {0, 1}); k uses the kv head count. `unpermute_rows` undoes it exactly. It moves whole rows,
so on quantized blocks it is a row gather of whole-block rows: no requantization.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

GLOBAL_NAMES: dict[str, str] = {  # GGUF name -> HF name
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES: dict[str, str] = {  # blk.N.<GGUF> -> model.layers.N.<HF>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a sparse layer: the router, the experts stacked (E, out, in), a shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # gpt-oss: the attention sinks (a parameter without a `.weight` in HF, `BARE`)
    "attn_sinks": "self_attn.sinks",
}
BARE = frozenset({"self_attn.sinks"})  # HF parameters named without `.weight`
# HF parameters named without `.weight` whose GGUF names are whole (qwen35's, as llama.cpp's
# converter names the Gated DeltaNet's A and dt bias)
WHOLE: dict[str, str] = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}
ROPE_FREQS = (
    "rope_freqs.weight"  # llama3 rope scaling as llama.cpp stores it: per-frequency divisors
)
_NONE: Mapping[str, str] = MappingProxyType({})
_TO_GGUF = {v: k for k, v in GLOBAL_NAMES.items()}
_LAYER_TO_GGUF = {v: k for k, v in LAYER_NAMES.items()}
_WHOLE_TO_HF = {g: h for h, g in WHOLE.items()}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
_GGUF_WHOLE = re.compile(r"blk\.(\d+)\.(" + "|".join(re.escape(g) for g in WHOLE.values()) + ")")
_HF_WHOLE = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(re.escape(h) for h in WHOLE) + ")")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_BARE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.sinks)")


class UnknownTensorNameError(KeyError):
    """A model parameter with no GGUF counterpart in the table."""


def hf_name(gguf: str, family_names: Mapping[str, str] = _NONE) -> str | None:
    """The HF name of GGUF tensor `gguf`, or None for one the model has no parameter for;
    `family_names` (HF -> GGUF, `Family.gguf_names`) where the file's family names a layer
    tensor its own way."""
    if gguf in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf]
    m = _GGUF_WHOLE.fullmatch(gguf)
    if m is not None:
        return f"model.layers.{m.group(1)}.{_WHOLE_TO_HF[m.group(2)]}"
    m = _GGUF_LAYER.fullmatch(gguf)
    if m is None:
        return None
    own = {g: h for h, g in family_names.items()}
    name = own.get(m.group(2)) or LAYER_NAMES.get(m.group(2))
    if name is None:
        return None
    if name in BARE:
        return f"model.layers.{m.group(1)}.{name}" if m.group(3) == "weight" else None
    return f"model.layers.{m.group(1)}.{name}.{m.group(3)}"


def gguf_name(hf: str, family_names: Mapping[str, str] = _NONE) -> str:
    """The GGUF name of the model parameter `hf` (`family_names` as for `hf_name`)."""
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    m = _HF_WHOLE.fullmatch(hf)
    if m is not None:
        return f"blk.{m.group(1)}.{WHOLE[m.group(2)]}"
    m = _HF_BARE.fullmatch(hf)
    if m is not None:
        return f"blk.{m.group(1)}.{_LAYER_TO_GGUF[m.group(2)]}.weight"
    m = _HF_LAYER.fullmatch(hf)
    if m is None or m.group(2) not in _LAYER_TO_GGUF and m.group(2) not in family_names:
        raise UnknownTensorNameError(f"parameter {hf!r} has no GGUF tensor name")
    base = family_names.get(m.group(2)) or _LAYER_TO_GGUF[m.group(2)]
    return f"blk.{m.group(1)}.{base}.{m.group(3)}"


def permuted_heads(hf: str, n_heads: int, n_kv_heads: int) -> int | None:
    """How many heads the llama converter permuted tensor `hf` by (q: n_heads, k: n_kv_heads),
    or None for a tensor it leaves alone."""
    if hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return n_heads
    if hf.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return n_kv_heads
    return None


Rows = TypeVar("Rows")  # a torch tensor or a numpy array: both are moved alike


def permute_rows(rows: Rows, n_heads: int) -> Rows:
    """HF rows (n_heads * hd, ...) -> llama.cpp's order (what its converter writes). A new
    contiguous copy, of the array type given (torch or numpy)."""
    hd = rows.shape[0] // n_heads
    split = rows.reshape(n_heads, 2, hd // 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(tuple(rows.shape))  # a non-contiguous view: reshape copies


def unpermute_rows(rows: Rows, n_heads: int) -> Rows:
    """llama.cpp's rows (n_heads * hd, ...) -> HF order; exact inverse of `permute_rows`. A new
    contiguous copy, of the array type given (torch or numpy)."""
    hd = rows.shape[0] // n_heads
    split = rows.reshape(n_heads, hd // 2, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(tuple(rows.shape))
