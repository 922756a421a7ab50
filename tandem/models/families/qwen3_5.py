"""The Qwen3.5 / Qwen3.6 hybrid (HF `Qwen3_5ForCausalLM`, model_type `qwen3_5_text`, and
`Qwen3_5MoeForCausalLM`, `qwen3_5_moe_text`; the text model of `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration`) as its differences from Llama:

    block              Qwen3.5                                         ModelConfig field
    token mixer        Gated DeltaNet on the `linear_attention`        deltanet (DeltaNetSpec)
                       layers (`layer_types`; absent: 3 of every
                       `full_attention_interval` = 4), gated full
                       attention on the others (`models.qwen35`)
    attention gate     q_proj holds per head hd query then hd gate     attn_output_gate
                       rows; out = o_proj(attn * sigmoid(gate))
    q/k                RMSNorm per head                                qk_norm
    RMSNorm            y = (1 + w) * x / rms(x), float32, rounded      norm_weight_offset = 1.0
                       once (the DeltaNet's gated norm: plain w)
    rope               partial: int(head_dim * partial_rotary_factor)  partial_rotary_factor
                       dims of each head (0.25 by default), from
                       `rope_parameters`
    FFN (MoE)          every layer sparse: softmax top-k, always       moe (shared_intermediate_
                       renormalised, plus a shared expert of           size)
                       `shared_expert_intermediate_size` gated by
                       sigmoid(shared_expert_gate(x))

M-RoPE (`mrope_section`, `mrope_interleaved`) is ignored: it splits the rotary frequencies among
time/height/width position ids, which for text are all the token's position, so every split
rotates by the same angle and M-RoPE equals the plain partial RoPE. The vision tower and the
multi-token-prediction head (`mtp.*`) of the released checkpoints are not read
(`multimodal.text_weight_names`). GGUF (`qwen35`, `qwen35moe`): `qwen3_5_gguf`.
"""

from __future__ import annotations

from typing import Any

from tandem import deltanet_config as dn
from tandem.config import OMIT, ConfigError, HFFields, ModelConfig
from tandem.models.families import qwen3_5_gguf as gguf
from tandem.models.families.base import Family
from tandem.models.families.multimodal import text_weight_names
from tandem.moe_config import MoESpec

# transformers' Qwen3_5TextConfig defaults: what a multimodal checkpoint's `text_config` omits
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 4096,
    "intermediate_size": 12_288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# Qwen3_5MoeTextConfig's; it has no dense `intermediate_size` (every layer is sparse): 0 here,
# replaced by the experts' width in `_moe_fields`
MOE_HF_DEFAULTS: dict[str, Any] = {
    **HF_DEFAULTS,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "intermediate_size": 0,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
DEFAULT_PARTIAL_ROTARY = 0.25


def _fields(r: HFFields) -> dict[str, Any]:
    """config.json -> the ModelConfig fields every Qwen3.5 model sets (module docstring)."""
    d, source = r.d, r.source
    layers = r.need("num_hidden_layers")
    try:
        linear = dn.linear_layers_of(
            d.get("layer_types"),
            layers,
            r.opt("full_attention_interval", int, dn.DEFAULT_FULL_INTERVAL),
        )
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    rope = d.get("rope_parameters") or {}
    partial = (rope if isinstance(rope, dict) else {}).get(
        "partial_rotary_factor", d.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
    )
    return {
        "deltanet": dn.DeltaNetSpec(
            linear_layers=linear,
            num_key_heads=r.need("linear_num_key_heads"),
            num_value_heads=r.need("linear_num_value_heads"),
            key_head_dim=r.need("linear_key_head_dim"),
            value_head_dim=r.need("linear_value_head_dim"),
            conv_kernel=r.need("linear_conv_kernel_dim"),
        ),
        "attn_output_gate": True,
        "qk_norm": True,
        "norm_weight_offset": 1.0,
        "partial_rotary_factor": r.typed(partial, float, "partial_rotary_factor"),
    }


def _moe_fields(r: HFFields) -> dict[str, Any]:
    width = r.need("moe_intermediate_size")
    moe = MoESpec(
        num_experts=r.need("num_experts"),
        top_k=r.need("num_experts_per_tok"),
        intermediate_size=width,
        norm_topk_prob=True,  # Qwen3_5MoeTopKRouter always renormalises
        shared_intermediate_size=r.opt("shared_expert_intermediate_size", int, 0),
    )
    return {**_fields(r), "moe": moe, "intermediate_size": width}


def _extras(c: ModelConfig) -> dict[str, Any]:
    s = c.deltanet
    assert s is not None
    return {
        "layer_types": dn.layer_types(s, c.num_hidden_layers),
        "linear_num_key_heads": s.num_key_heads,
        "linear_num_value_heads": s.num_value_heads,
        "linear_key_head_dim": s.key_head_dim,
        "linear_value_head_dim": s.value_head_dim,
        "linear_conv_kernel_dim": s.conv_kernel,
        "attention_bias": c.qkv_bias,
        "rope_theta": OMIT,
        "rope_scaling": OMIT,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor,
        },
    }


def _moe_extras(c: ModelConfig) -> dict[str, Any]:
    m = c.moe
    assert m is not None
    return {
        **_extras(c),
        "intermediate_size": OMIT,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.intermediate_size,
        "shared_expert_intermediate_size": m.shared_intermediate_size,
    }


GGUF_SIDE: dict[str, Any] = dict(  # `qwen3_5_gguf`
    gguf_fields=gguf.gguf_fields,
    gguf_write=gguf.gguf_write,
    gguf_names=gguf.GGUF_NAMES,
    gguf_store=gguf.gguf_store,
    gguf_partial_rotary=True,
)
DENSE = Family(
    architecture="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    multimodal=("Qwen3_5ForConditionalGeneration",),
    hf_defaults=HF_DEFAULTS,
    hf_fields=_fields,
    hf_extras=_extras,
    checkpoint_renames=text_weight_names,
    **GGUF_SIDE,
    gguf_arch="qwen35",
)
MOE = Family(
    architecture="Qwen3_5MoeForCausalLM",
    model_type="qwen3_5_moe_text",
    multimodal=("Qwen3_5MoeForConditionalGeneration",),
    hf_defaults=MOE_HF_DEFAULTS,
    hf_fields=_moe_fields,
    hf_extras=_moe_extras,
    checkpoint_renames=text_weight_names,
    **GGUF_SIDE,
    gguf_arch="qwen35moe",
)
