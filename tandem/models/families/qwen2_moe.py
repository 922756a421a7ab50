"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 (biases on q, k and v) whose feed-forward is the
MoE block with a shared expert, Qwen3-MoE's experts (`qwen3_moe.moe_spec`: softmax over
`num_experts`, the top `num_experts_per_tok`, renormalised only with `norm_topk_prob`, off by
default; dense layers by `mlp_only_layers` / `decoder_sparse_step`) plus

    y += sigmoid(shared_expert_gate(x)) * down_s(silu(gate_s x) * up_s x)

of `shared_expert_intermediate_size` rows on every sparse layer. Its GGUF files (`qwen2moe`, as
llama.cpp's converter writes them) hold the shared expert as `ffn_{gate,up,down}_shexp` and its
gate as `ffn_gate_inp_shexp`; llama.cpp's graph never renormalises the top k, so a file that
states no `expert_weights_norm` is read with it off (`gguf_norm_topk_prob`)."""

from typing import Any

from tandem.config import ConfigError, HFFields, ModelConfig
from tandem.models.families.base import Family
from tandem.models.families.qwen3_moe import moe_extras, moe_spec


def _hf_fields(r: HFFields) -> dict[str, Any]:
    if r.get("use_sliding_window"):
        raise ConfigError(f"{r.source}: Qwen2-MoE 'use_sliding_window' is not supported")
    shared = r.opt("shared_expert_intermediate_size", int, 0)
    return {
        "qkv_bias": bool(r.get("qkv_bias", True)),
        "o_bias": False,
        "moe": moe_spec(r, shared_intermediate_size=shared),
    }


def _hf_extras(c: ModelConfig) -> dict[str, Any]:
    return {
        **moe_extras(c),
        "qkv_bias": c.qkv_bias,
        "shared_expert_intermediate_size": c.moe.shared_intermediate_size,
    }


FAMILY = Family(
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    hf_fields=_hf_fields,
    hf_extras=_hf_extras,
    gguf_arch="qwen2moe",
    gguf_norm_topk_prob=False,
)
