"""Real models' shapes as `ModelConfig`s, for tests that size, plan or partition them without
weights (the numbers are the released configs')."""

from tandem.config import ModelConfig
from tandem.moe_config import MoESpec


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B: 48 layers, D 2048, 32 q / 4 kv heads of 128 (q/k norms), 128 experts of
    width 768 with 8 active (top-k probabilities renormalized), every layer sparse (the dense MLP
    width 6144 unused), 151 936 tokens, untied head."""
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, qk_norm=True,
        tie_word_embeddings=False,
        moe=MoESpec(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True),
    )  # fmt: skip
