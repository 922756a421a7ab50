"""Qwen3-MoE: Qwen3 whose feed-forward is the MoE block (`models.moe`): softmax over
`num_experts`, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`, experts of width
`moe_intermediate_size`; the layers in `mlp_only_layers`, and every layer i with
(i + 1) % decoder_sparse_step != 0, keep the dense MLP. Its GGUF files (`qwen3moe`) state the
experts in metadata (`loaders.gguf.config`)."""

from typing import Any

from tandem.config import ConfigError, HFFields, ModelConfig
from tandem.models.families.base import Family
from tandem.models.families.qwen3 import QK_NORM
from tandem.moe_config import MoESpec


def _hf_fields(r: HFFields) -> dict[str, Any]:
    only = r.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"{r.source}: 'mlp_only_layers' must be a list of layer indices")
    step = r.opt("decoder_sparse_step", int, 1)
    if step < 1:
        raise ConfigError(f"{r.source}: decoder_sparse_step {step} must be >= 1")
    layers = r.need("num_hidden_layers")
    moe = MoESpec(
        num_experts=r.opt("num_experts", int, None) or r.need("num_local_experts"),
        top_k=r.need("num_experts_per_tok"),
        intermediate_size=r.need("moe_intermediate_size"),
        norm_topk_prob=bool(r.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step != 0),
    )
    return {**QK_NORM, "moe": moe}


def _hf_extras(c: ModelConfig) -> dict[str, Any]:
    return {
        "attention_bias": False,
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
    hf_fields=_hf_fields,
    hf_extras=_hf_extras,
    gguf_arch="qwen3moe",
    gguf_fields=lambda g: QK_NORM,
)
