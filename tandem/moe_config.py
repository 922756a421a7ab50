"""`MoESpec`: the mixture-of-experts part of a model's shape, as the HF configs of the supported
families state it (each family's declaration in `tandem.models.families` reads its own fields;
torch-free: `config` and the GGUF loader read it).

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

# "softmax_topk": softmax over every expert, then the top-k (renormalised or not);
# "topk_softmax": the top-k logits, then a softmax over those k (gpt-oss)
ROUTERS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("swiglu", "swiglu_clamped")
MAX_EXPERTS = 4096


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
