"""gpt-oss: Llama with biases on q, k, v and o, a learned sink logit per head in every softmax
(`attn_sinks`), a sliding window (`sliding_window`, 128) on the layers `layer_types` marks
`sliding_attention` (by default the even ones), YaRN rope (theta 150000 by default), and the MoE
block on every layer: the top `num_experts_per_tok` of the biased router logits, softmax over those
k, biased experts with the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`; `moe_config`).

OpenAI's released checkpoints store the experts in MXFP4 (`quantization_config` "mxfp4",
`loaders.mxfp4_dir`); everything else (attention, router, embeddings, head) stays bf16.

Its GGUF files (`gpt-oss`) name the norm before the feed-forward `post_attention_norm`, and put the
window on the even layers (llama.cpp's pattern)."""

from typing import Any

from tandem.config import OMIT, ConfigError, HFFields, ModelConfig, alternating_window_layers
from tandem.models.families.base import Family
from tandem.moe_config import MoESpec

_SLIDING, _FULL = "sliding_attention", "full_attention"
# what OpenAI's MXFP4 checkpoints state transformers must leave unquantized: all but the experts
_NOT_MXFP4 = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def moe_spec(num_experts: int, top_k: int, width: int, **kw: Any) -> MoESpec:
    """gpt-oss's experts: `kw` sets the biases and the SwiGLU constants where a source states them."""
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=False,
        router="topk_softmax",
        activation="swiglu_clamped",
        **{"router_bias": True, "expert_bias": True, **kw},
    )


def _window_layers(r: HFFields, n: int) -> tuple[int, ...]:
    """The sliding layers: `layer_types` as stated, else `alternating_window_layers`."""
    types = r.get("layer_types")
    if types is None:
        return alternating_window_layers(n)
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in (_SLIDING, _FULL) for t in types)
    ):
        raise ConfigError(f"{r.source}: 'layer_types' must list {n} of '{_SLIDING}' / '{_FULL}'")
    return tuple(i for i, t in enumerate(types) if t == _SLIDING)


def _hf_fields(r: HFFields) -> dict[str, Any]:
    moe = moe_spec(
        r.opt("num_local_experts", int, 128),
        r.opt("num_experts_per_tok", int, 4),
        r.need("intermediate_size"),
        swiglu_alpha=r.opt("swiglu_alpha", float, 1.702),
        swiglu_limit=r.opt("swiglu_limit", float, 7.0),
    )
    return {
        "sliding_window": r.opt("sliding_window", int, 128),
        "window_layers": _window_layers(r, r.need("num_hidden_layers")),
        "attn_sinks": True,
        "moe": moe,
    }


def _hf_extras(c: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {
        "attention_bias": c.o_bias,
        "sliding_window": c.sliding_window,
        "layer_types": [
            _FULL if c.window(i) is None else _SLIDING for i in range(c.num_hidden_layers)
        ],
        "num_local_experts": c.moe.num_experts,
        "num_experts_per_tok": c.moe.top_k,
        "swiglu_alpha": c.moe.swiglu_alpha,
        "swiglu_limit": c.moe.swiglu_limit,
    }
    if c.rope_scaling is not None:  # transformers reads gpt-oss's yarn only from here
        d["rope_parameters"] = {"rope_theta": c.rope_theta, **c.rope_scaling.to_hf_dict()}
        d["rope_scaling"] = OMIT
    if c.quant_method == "mxfp4":
        d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": _NOT_MXFP4}
    return d


def _gguf_fields(g: Any) -> dict[str, Any]:
    window = g.meta.get(g.a + "attention.sliding_window", int, None)
    moe = moe_spec(
        g.meta.get(g.a + "expert_count", int),
        g.meta.get(g.a + "expert_used_count", int),
        g.meta.get(g.a + "expert_feed_forward_length", int, None)
        or g.meta.get(g.a + "feed_forward_length", int),
        router_bias="blk.0.ffn_gate_inp.bias" in g.tensors,
        expert_bias="blk.0.ffn_gate_exps.bias" in g.tensors,
    )
    return {
        "sliding_window": window,
        "window_layers": alternating_window_layers(g.layers) if window else None,
        "attn_sinks": True,
        "moe": moe,
    }


def _gguf_write(w: Any, c: ModelConfig) -> None:
    if c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)


FAMILY = Family(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    hf_fields=_hf_fields,
    hf_extras=_hf_extras,
    rope_theta=150000.0,
    attention_bias=True,
    gguf_arch="gpt-oss",
    gguf_fields=_gguf_fields,
    gguf_write=_gguf_write,
    gguf_names={"post_attention_layernorm": "post_attention_norm"},
    quant_methods=("mxfp4",),
)
