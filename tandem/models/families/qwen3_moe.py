"""Qwen3-MoE: Qwen3 whose feed-forward is the MoE block (`models.moe`): softmax over
`num_experts`, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`, experts of width
`moe_intermediate_size`; the layers in `mlp_only_layers`, and every layer i with
(i + 1) % decoder_sparse_step != 0, keep the dense MLP. Its GGUF files (`qwen3moe`) state the
experts in metadata (`loaders.gguf.config`). Qwen2-MoE (`qwen2_moe`) reads its experts with the
same `moe_spec` and `moe_extras`."""

from typing import Any

from tandem.config import ConfigError, HFFields, ModelConfig
from tandem.models.families.base import Family
from tandem.models.families.qwen3 import QK_NORM
from tandem.moe_config import MoESpec


def moe_spec(r: HFFields, shared_intermediate_size: int = 0) -> MoESpec:
    """The experts a Qwen-MoE config.json states (module docstring), with a shared expert of
    `shared_intermediate_size` rows when > 0."""
    only = r.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"{r.source}: 'mlp_only_layers' must be a list of layer indices")
    step = r.opt("decoder_sparse_step", int, 1)
    if step < 1:
        raise ConfigError(f"{r.source}: decoder_sparse_step {step} must be >= 1")
    layers = r.need("num_hidden_layers")
    return MoESpec(
        num_experts=r.opt("num_experts", int, None) or r.need("num_local_experts"),
        top_k=r.need("num_experts_per_tok"),
        intermediate_size=r.need("moe_intermediate_size"),
        norm_topk_prob=bool(r.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step != 0),
        shared_intermediate_size=shared_intermediate_size,
    )


def moe_extras(c: ModelConfig) -> dict[str, Any]:
    """`moe_spec`'s fields back, as config.json states them."""
    return {
        "use_sliding_window": False,
        "num_experts": c.moe.num_experts,
        "num_experts_per_tok": c.moe.top_k,
        "moe_intermediate_size": c.moe.intermediate_size,
        "norm_topk_prob": c.moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(c.moe.dense_layers),
    }


FAMILY = Family(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    hf_fields=lambda r: {**QK_NORM, "moe": moe_spec(r)},
    hf_extras=lambda c: {"attention_bias": False, **moe_extras(c)},
    gguf_arch="qwen3moe",
    gguf_fields=lambda g: QK_NORM,
)
