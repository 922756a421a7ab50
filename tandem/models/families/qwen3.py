"""Qwen3: Llama with an RMSNorm over each head's q and k before RoPE (`qk_norm`)."""

from tandem.models.families.base import Family

QK_NORM = {"qk_norm": True}

FAMILY = Family(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    hf_fields=lambda r: QK_NORM,
    hf_extras=lambda c: {"attention_bias": False, "use_sliding_window": False},
    gguf_arch="qwen3",
    gguf_fields=lambda g: QK_NORM,
)
