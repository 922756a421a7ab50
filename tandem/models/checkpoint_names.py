"""The checkpoint tensor names a whole model reads, from its config alone (no torch): the names
`Transformer(config)` loads its parameters from (`Transformer.checkpoint_name` of each), so a
loader can check a file's tensors without building a model."""

from __future__ import annotations

from tandem.config import ModelConfig


def checkpoint_names(config: ModelConfig) -> frozenset[str]:
    """Every checkpoint tensor the whole model (all layers, embedding and head) reads: a tied
    `lm_head` reads `model.embed_tokens.weight`, so `lm_head.weight` is not among them."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        for proj, bias in (
            ("q_proj", config.qkv_bias),
            ("k_proj", config.qkv_bias),
            ("v_proj", config.qkv_bias),
            ("o_proj", config.o_bias),
        ):
            names.add(f"{p}.self_attn.{proj}.weight")
            if bias:
                names.add(f"{p}.self_attn.{proj}.bias")
        if config.qk_norm:
            names |= {f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"{p}.mlp.{proj}.weight")
            if config.mlp_bias:
                names.add(f"{p}.mlp.{proj}.bias")
    return frozenset(names)
