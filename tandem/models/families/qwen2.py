"""Qwen2: Llama with biases on q, k and v (never on o). Its `use_sliding_window` is refused."""

from typing import Any

from tandem.config import ConfigError, HFFields
from tandem.models.families.base import Family


def _hf_fields(r: HFFields) -> dict[str, Any]:
    if r.get("use_sliding_window"):
        raise ConfigError(f"{r.source}: Qwen2 'use_sliding_window' is not supported")
    return {"qkv_bias": True, "o_bias": False}


FAMILY = Family(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    hf_fields=_hf_fields,
    hf_extras=lambda c: {"use_sliding_window": False},
    gguf_arch="qwen2",
    gguf_fields=lambda g: {"qkv_bias": True},
)
