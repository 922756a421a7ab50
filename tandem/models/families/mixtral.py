"""Mixtral: Mistral whose every feed-forward is the MoE block: softmax over `num_local_experts`,
the top `num_experts_per_tok` renormalised, experts of width `intermediate_size`. Its GGUF files
are `llama` files whose layers hold `ffn_*_exps` tensors (q/k rows permuted, as Llama's)."""

from typing import Any

from tandem.config import HFFields, ModelConfig
from tandem.models.families.base import Family
from tandem.moe_config import MoESpec


def _hf_fields(r: HFFields) -> dict[str, Any]:
    moe = MoESpec(
        num_experts=r.opt("num_local_experts", int, 8),
        top_k=r.opt("num_experts_per_tok", int, 2),
        intermediate_size=r.need("intermediate_size"),
        norm_topk_prob=True,
    )
    return {"moe": moe, "sliding_window": r.opt("sliding_window", int, None) or None}


def _hf_extras(c: ModelConfig) -> dict[str, Any]:
    return {
        "sliding_window": c.sliding_window,
        "num_local_experts": c.moe.num_experts,
        "num_experts_per_tok": c.moe.top_k,
    }


FAMILY = Family(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    hf_fields=_hf_fields,
    hf_extras=_hf_extras,
    gguf_arch="llama",
    gguf_experts=True,
    permuted_qk=True,
)
