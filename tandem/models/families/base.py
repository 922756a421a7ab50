"""`Family`: what one model family declares about itself.

Every supported family is the Llama decoder (`models.llama`) with a few switches set: q/k norms,
biases, a sliding window on some layers, attention sinks, a mixture of experts. A family's module
in this package states exactly those, for both ways a model arrives:

    architecture, model_type   the HF names (`config.json`'s `architectures[0]` and `model_type`)
    multimodal                 HF architectures whose `text_config` is this family's (their text
                               weights renamed by `checkpoint_renames`)
    hf_defaults                transformers' defaults, laid under what config.json states
    own_activation             its `hf_fields` reads and checks the activation (else only SiLU)
    own_rope                   its `hf_fields` reads the rope scaling (a type only it runs)
    hf_fields(r)               the `ModelConfig` fields its config.json sets beyond the shape every
                               family shares (`ModelConfig.from_hf_dict`; `r` is a `config.HFFields`)
    hf_extras(c)               the config.json fields transformers needs back (`to_hf_dict`)
    rope_theta, attention_bias transformers' defaults where config.json states no value
    gguf_arch, gguf_experts    the GGUF `general.architecture` it is read from (`gguf_experts`: only
                               files whose layers hold expert tensors, as Mixtral's `llama` files)
    gguf_norm_topk_prob        what a file of its experts that states no `expert_weights_norm`
                               means (llama.cpp's graph for the architecture)
    gguf_write(w, c)           the family's own metadata, written to a gguf-py `GGUFWriter`
    gguf_fields(g)             the fields its GGUF metadata sets beyond the shape every family shares
                               (`loaders.gguf.config`; `g` is a `GGUFFields`)
    gguf_names                 HF module -> GGUF tensor name, where the family's files differ
    gguf_store(c, name, x)     tensor `name` as the family's GGUF files store it (Gemma: 1 + w)
    gguf_partial_rotary        `rope.dimension_count` may be less than the head (its gguf_fields
                               reads it)
    gguf_config_tensors        field -> GGUF tensor whose values configure the model (Phi-3's
                               longrope factors), read for `gguf_fields` (`GGUFFields.values`)
    checkpoint_renames(names)  the reference name -> checkpoint name of tensors stored elsewhere
    fused_rows(c)              checkpoint projections that hold several of the reference's, by
                               rows (`loaders.fused_rows`: Phi-3's qkv_proj, gate_up_proj)
    permuted_qk                llama.cpp's converter permuted its q/k rows (`gguf.names`)
    quant_methods              config.json `quantization_config.quant_method`s its checkpoints
                               may state (gpt-oss: "mxfp4"); any other is refused

The module is torch-free (config parsing runs in processes that never import torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _nothing(_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family's declaration (module docstring)."""

    architecture: str
    model_type: str
    multimodal: tuple[str, ...] = ()
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    own_activation: bool = False
    own_rope: bool = False
    hf_fields: Callable[[Any], dict[str, Any]] = _nothing
    hf_extras: Callable[[Any], dict[str, Any]] = _nothing
    rope_theta: float = 10000.0
    attention_bias: bool = False
    gguf_arch: str | None = None
    gguf_experts: bool = False
    gguf_norm_topk_prob: bool = True
    gguf_fields: Callable[[Any], dict[str, Any]] = _nothing
    gguf_write: Callable[[Any, Any], None] = lambda w, c: None
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    permuted_qk: bool = False
    gguf_store: Callable[[Any, str, Any], Any] = lambda c, name, x: x
    gguf_partial_rotary: bool = False
    gguf_config_tensors: Mapping[str, str] = field(default_factory=dict)
    checkpoint_renames: Callable[[Any], dict[str, str]] = _nothing
    fused_rows: Callable[[Any], dict[str, Any]] = _nothing
    quant_methods: tuple[str, ...] = ()
