"""Llama (and SmolLM, and every `llama` GGUF file whose layers hold no experts): the skeleton
itself. Its projections carry biases only when config.json sets `attention_bias` (q, k, v, o) or
`mlp_bias`; llama.cpp's converter permutes its q/k rows."""

from tandem.models.families.base import Family

FAMILY = Family(
    architecture="LlamaForCausalLM",
    model_type="llama",
    hf_extras=lambda c: {"attention_bias": c.o_bias, "mlp_bias": c.mlp_bias},
    gguf_arch="llama",
    permuted_qk=True,
)
