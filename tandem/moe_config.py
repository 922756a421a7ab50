"""`MoESpec`: the mixture-of-experts part of a model's shape, as the HF configs of the supported
families state it (torch-free: `config` and the GGUF loader read it).

    family (HF architecture)   experts / top-k fields                   router                dense layers
    Qwen3MoeForCausalLM        num_experts, num_experts_per_tok,        softmax, top-k,       mlp_only_layers, and
                               moe_intermediate_size                    renormalised when     every layer with
                                                                        norm_topk_prob        (i + 1) % decoder_sparse_step
    MixtralForCausalLM         num_local_experts, num_experts_per_tok,  softmax, top-k,       none
                               intermediate_size                        always renormalised
    GptOssForCausalLM          num_local_experts, num_experts_per_tok,  top-k of the biased   none
                               intermediate_size                        logits, softmax over
                                                                        those k

A sparse layer's feed-forward is `sum_{e in topk(x)} p_e(x) * down_e(act(gate_e x, up_e x))`
(`tandem.models.moe`); the others keep the dense MLP of `intermediate_size`. `act` is SwiGLU,
silu(g) * u, except gpt-oss's clamped form (`activation = "swiglu_clamped"`):

    g' = min(g, limit),  u' = clamp(u, -limit, limit),  act = (u' + 1) * g' * sigmoid(alpha g')

whose experts also carry biases (gate/up/down, `expert_bias`), as its router does (`router_bias`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# "softmax_topk": softmax over every expert, then the top-k (renormalised or not);
# "topk_softmax": the top-k logits, then a softmax over those k (gpt-oss)
ROUTERS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("swiglu", "swiglu_clamped")
MAX_EXPERTS = 4096


class MoEConfigError(ValueError):
    """An MoE field missing, of the wrong type, or outside what tandem runs."""


@dataclass(frozen=True)
class MoESpec:
    """Experts of a sparse layer: `num_experts` SwiGLU experts of width `intermediate_size`, `top_k`
    of them weighted per token by the router; `dense_layers` keep the dense MLP instead;
    `shared_intermediate_size` > 0 adds a sigmoid-gated shared expert to every sparse layer;
    `router_bias`, `expert_bias`, `activation` and its `swiglu_alpha`/`swiglu_limit` as in the
    module docstring."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    router: str = "softmax_topk"
    dense_layers: tuple[int, ...] = ()
    shared_intermediate_size: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def validate(self, num_layers: int) -> None:
        from tandem.config import ConfigFieldError

        checks = (
            ("num_experts", self.num_experts, 1, MAX_EXPERTS),
            ("num_experts_per_tok", self.top_k, 1, self.num_experts),
            ("moe_intermediate_size", self.intermediate_size, 1, 1 << 18),
            ("shared_expert_intermediate_size", self.shared_intermediate_size, 0, 1 << 18),
        )
        for name, v, lo, hi in checks:
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigFieldError(name, v, f"[{lo}, {hi}]")
        if self.router not in ROUTERS:
            raise ConfigFieldError("router", self.router, f"one of {', '.join(ROUTERS)}")
        if self.activation not in ACTIVATIONS:
            raise ConfigFieldError(
                "activation", self.activation, f"one of {', '.join(ACTIVATIONS)}"
            )
        for name, v in (("swiglu_alpha", self.swiglu_alpha), ("swiglu_limit", self.swiglu_limit)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 1e-6 <= v <= 1e6:
                raise ConfigFieldError(name, v, "[1e-06, 1e+06] (finite)")
        if any(not 0 <= i < num_layers for i in self.dense_layers):
            raise ConfigFieldError("mlp_only_layers", self.dense_layers, f"[0, {num_layers})")


def moe_checkpoint_names(spec: MoESpec) -> list[str]:
    """The tensors of one sparse layer, relative to `model.layers.<i>.` (the reference model's
    names: each projection's experts stacked as one (E, out, in) tensor)."""
    names = ["mlp.gate.weight"] + (["mlp.gate.bias"] if spec.router_bias else [])
    for p in ("gate", "up", "down"):
        names.append(f"mlp.experts.{p}_proj.weight")
        if spec.expert_bias:
            names.append(f"mlp.experts.{p}_proj.bias")
    if spec.shared_intermediate_size:
        names += [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
        names.append("mlp.shared_expert_gate.weight")
    return names


def _int(d: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise MoEConfigError(f"{source}: field {key!r} must be an integer, got {v!r}")
    return v


def _float(d: dict[str, Any], key: str, source: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise MoEConfigError(f"{source}: field {key!r} must be a number, got {v!r}")
    return float(v)


def parse_moe(arch: str, d: dict[str, Any], num_layers: Any, source: str) -> MoESpec | None:
    """The MoE spec of an HF config dict (module docstring), None for a dense architecture."""
    if arch == "MixtralForCausalLM":
        return MoESpec(
            num_experts=_int(d, "num_local_experts", source, 8),
            top_k=_int(d, "num_experts_per_tok", source, 2),
            intermediate_size=_int(d, "intermediate_size", source),
            norm_topk_prob=True,
        )
    if arch == "GptOssForCausalLM":
        return MoESpec(
            num_experts=_int(d, "num_local_experts", source, 128),
            top_k=_int(d, "num_experts_per_tok", source, 4),
            intermediate_size=_int(d, "intermediate_size", source),
            norm_topk_prob=False,
            router="topk_softmax",
            router_bias=True,
            expert_bias=True,
            activation="swiglu_clamped",
            swiglu_alpha=_float(d, "swiglu_alpha", source, 1.702),
            swiglu_limit=_float(d, "swiglu_limit", source, 7.0),
        )
    if arch != "Qwen3MoeForCausalLM":
        return None
    n = _int(d, "num_experts", source, d.get("num_local_experts"))
    step = _int(d, "decoder_sparse_step", source, 1)
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise MoEConfigError(f"{source}: 'mlp_only_layers' must be a list of layer indices")
    if step < 1:
        raise MoEConfigError(f"{source}: decoder_sparse_step {step} must be >= 1")
    layers = num_layers if isinstance(num_layers, int) else 0
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    return MoESpec(
        num_experts=n,
        top_k=_int(d, "num_experts_per_tok", source),
        intermediate_size=_int(d, "moe_intermediate_size", source),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        dense_layers=dense,
    )


def moe_hf_fields(arch: str, spec: MoESpec, num_layers: int) -> dict[str, Any]:
    """The config.json fields transformers reads for `spec` (the inverse of `parse_moe`)."""
    if arch == "MixtralForCausalLM":
        return {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.top_k}
    if arch == "GptOssForCausalLM":
        return {
            "num_local_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "swiglu_alpha": spec.swiglu_alpha,
            "swiglu_limit": spec.swiglu_limit,
        }
    return {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "moe_intermediate_size": spec.intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(spec.dense_layers),
    }
