"""Mistral: Llama with a sliding window on every layer when config.json states `sliding_window`.
Its GGUF files are `llama` files (read as Llama)."""

from tandem.models.families.base import Family

FAMILY = Family(
    architecture="MistralForCausalLM",
    model_type="mistral",
    hf_fields=lambda r: {"sliding_window": r.opt("sliding_window", int, None) or None},
    hf_extras=lambda c: {"sliding_window": c.sliding_window},
)
