"""The supported model families, one declaration each (`base.Family`), and their lookups.

Adding a family is one module here: its `FAMILY` states what config.json and GGUF metadata set
beyond the Llama skeleton, and one line in `FAMILIES` registers it. The reference model
(`models.llama`) builds its blocks from the `ModelConfig` switches a family sets.
"""

from __future__ import annotations

from tandem.models.families import (
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
)
from tandem.models.families.base import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    mixtral.FAMILY,
    gpt_oss.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    qwen3_5.DENSE,
    qwen3_5.MOE,
)
_BY_ARCH = {a: f for f in FAMILIES for a in (f.architecture, *f.multimodal)}
_BY_TYPE = {f.model_type: f for f in FAMILIES}
GGUF_ARCHITECTURES = tuple(dict.fromkeys(f.gguf_arch for f in FAMILIES if f.gguf_arch))


def by_architecture(arch: str | None) -> Family | None:
    """The family of HF architecture `arch` (`LlamaForCausalLM`, ...; a multimodal one whose text
    model a family is), or None."""
    return _BY_ARCH.get(arch or "")


def by_model_type(model_type: str | None) -> Family | None:
    """The family of HF `model_type` (`llama`, `qwen3_moe`, ...), or None."""
    return _BY_TYPE.get(model_type or "")


def by_gguf(arch: str, has_experts: bool) -> Family | None:
    """The family a GGUF file of `general.architecture` `arch` is read as: the one declaring
    `gguf_experts` when its layers hold expert tensors and one does, else the plain one."""
    found = [f for f in FAMILIES if f.gguf_arch == arch]
    for f in found:
        if f.gguf_experts == has_experts:
            return f
    return next((f for f in found if not f.gguf_experts), None)


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCH)
