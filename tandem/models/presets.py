"""Named model shapes and their deterministic random weights, for tests and benchmarks (no model can
be downloaded on the machines this project is built on).

Random-weight init, chosen so greedy decoding is *stable across dtypes* (a 16-bit run follows the
float32 reference's greedy ids for many tokens) while outputs still depend on the context:
- every weight is rounded to bfloat16 before it is stored, so f32, bf16 and f16 runs multiply the
  very same numbers and differ only in activation rounding;
- hidden projections have std 1/sqrt(fan_in) (o_proj and down_proj divided by sqrt(2 * layers)),
  so activations neither vanish nor explode and every layer matters;
- the output matrix (lm_head, or the tied embedding) gives logits of std LOGIT_STD and has a small set of "hot" rows (`HOT_ROWS`,
  printable tokens when the preset has a tokenizer) scaled up by `HOT_SCALE`: the argmax lands
  among them with a top-1/top-2 gap of a large fraction of the logit scale, instead of the
  near-ties of a 150k-way Gaussian maximum that 16-bit rounding would flip every few tokens;
- with tied embeddings the final norm weight gets random signs, so a token's own embedding is not
  an attractor (otherwise the model would just repeat its input);
- Gemma's norms (`norm_weight_offset`) store the weight less the offset, so every family's norms
  scale alike; sandwich layers' post-block norms scale by 1/sqrt(2 * layers), as o_proj and
  down_proj do elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tandem.config import ModelConfig, RopeScaling, yarn_attention_factor
from tandem.deltanet_config import DeltaNetSpec
from tandem.models.families import phi3
from tandem.moe_config import MoESpec

HOT_ROWS = 24
HOT_SCALE = 4.0
LOGIT_STD = 2.0  # std of an ordinary (not hot) row's logit


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    tokenizer_vocab: int | None  # size of the byte-level BPE to build, None for no tokenizer
    dtype: torch.dtype  # dtype the safetensors file stores


def _tiny(arch: str, **kw) -> ModelConfig:
    base = dict(
        architecture=arch,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(0,),
    )
    base.update(kw)
    return ModelConfig(**base)


def _qwen3(hidden: int, intermediate: int) -> Preset:
    """A Qwen3 release's shape (28 layers, 16 q / 8 kv heads of 128, tied, 151936 tokens),
    bfloat16 weights and a 4096-token byte-level BPE."""
    config = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_ids=(0,),
        torch_dtype="bfloat16",
    )
    return Preset(config, tokenizer_vocab=4096, dtype=torch.bfloat16)


def _qwen3_moe_bench() -> Preset:
    """Qwen3-30B-A3B's expert shape (64 of its 128 experts, 8 active, width 768; 16 q / 4 kv heads
    of 128) on 7 layers of width 1024: ~1.25 B parameters, ~0.3 B active per token."""
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=7,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_ids=(0,),
        torch_dtype="bfloat16",
        moe=MoESpec(num_experts=64, top_k=8, intermediate_size=768, norm_topk_prob=True),
    )
    return Preset(config, tokenizer_vocab=4096, dtype=torch.bfloat16)


def _tiny_gemma3(**kw) -> ModelConfig:
    """Gemma 3's blocks at tiny size: 7 layers (local 0-4 and 6, global 5: the 5:1 pattern),
    MQA (one kv head), a window of 8, local rope base 10000 and linearly scaled global rope 1e6,
    an attention scalar other than head_dim."""
    base = dict(
        num_hidden_layers=7,
        num_key_value_heads=1,
        qk_norm=True,
        sliding_window=8,
        window_layers=(0, 1, 2, 3, 4, 6),
        rope_theta=1_000_000.0,
        rope_scaling=RopeScaling("linear", 8.0),
        rope_local_theta=10_000.0,
        norm_placement="sandwich",
        norm_weight_offset=1.0,
        mlp_activation="gelu_tanh",
        embed_scale=64**0.5,
        query_pre_attn_scalar=24.0,
        bos_token_id=2,
    )
    return _tiny("Gemma3ForCausalLM", **{**base, **kw})


def _tiny_qwen35(arch: str, **kw) -> ModelConfig:
    """The Qwen3.5 hybrid at tiny size: 4 layers, Gated DeltaNet on 0-2 and gated attention on
    3 (the 3:1 pattern), 2 q/k heads of 8 serving 4 v heads of 12, a conv window of 4, partial
    rotary (a quarter of each head), (1 + w) norms."""
    base = dict(
        num_hidden_layers=4,
        tie_word_embeddings=False,
        qk_norm=True,
        norm_weight_offset=1.0,
        attn_output_gate=True,
        partial_rotary_factor=0.25,
        deltanet=DeltaNetSpec(
            linear_layers=(0, 1, 2),
            num_key_heads=2,
            num_value_heads=4,
            key_head_dim=8,
            value_head_dim=12,
        ),
    )
    return _tiny(arch, **{**base, **kw})


_TINY_MOE = MoESpec(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True)

PRESETS: dict[str, Preset] = {
    "qwen3-0.6b": _qwen3(1024, 3072),
    # for benchmarks at the size people run (a ~1.1 GB Q4_K_M file)
    "qwen3-1.7b": _qwen3(2048, 6144),
    "qwen3-moe-1.2b": _qwen3_moe_bench(),
    "tiny-llama": Preset(_tiny("LlamaForCausalLM"), 512, torch.float32),
    "tiny-llama-untied": Preset(
        _tiny("LlamaForCausalLM", tie_word_embeddings=False), 512, torch.float32
    ),
    "tiny-llama3-rope-scaling": Preset(
        _tiny(
            "LlamaForCausalLM",
            rope_theta=500000.0,
            rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
        ),
        512,
        torch.float32,
    ),
    "tiny-mistral": Preset(
        _tiny("MistralForCausalLM", num_key_value_heads=1, sliding_window=64), 512, torch.float32
    ),
    "tiny-qwen2": Preset(_tiny("Qwen2ForCausalLM", qkv_bias=True), 512, torch.float32),
    "tiny-qwen3": Preset(_tiny("Qwen3ForCausalLM", qk_norm=True), 512, torch.float32),
    # untied, three layers, no tokenizer: prompts given as token ids
    "tiny-qwen3-untied": Preset(
        _tiny("Qwen3ForCausalLM", qk_norm=True, tie_word_embeddings=False, num_hidden_layers=3),
        None,
        torch.float32,
    ),
    # mixture of experts: 8 experts, 2 active; Qwen3-MoE with a dense layer (1) among sparse ones
    "tiny-qwen3-moe": Preset(
        _tiny(
            "Qwen3MoeForCausalLM",
            qk_norm=True,
            num_hidden_layers=3,
            moe=replace(_TINY_MOE, norm_topk_prob=False, dense_layers=(1,)),
        ),
        512,
        torch.float32,
    ),
    # Qwen2-MoE: q/k/v biases, the top 2 of 8 not renormalised, a sigmoid-gated shared expert
    # of 128 rows on the sparse layers, a dense layer (1) among them
    "tiny-qwen2-moe": Preset(
        _tiny(
            "Qwen2MoeForCausalLM",
            qkv_bias=True,
            num_hidden_layers=3,
            moe=replace(
                _TINY_MOE, norm_topk_prob=False, dense_layers=(1,), shared_intermediate_size=128
            ),
        ),
        512,
        torch.float32,
    ),
    # gpt-oss: biased router, top-k then softmax, clamped SwiGLU experts with biases, attention
    # sinks, a sliding window of 8 on the even layers, YaRN
    "tiny-gpt-oss": Preset(
        _tiny(
            "GptOssForCausalLM",
            tie_word_embeddings=False,
            num_hidden_layers=3,
            intermediate_size=64,
            qkv_bias=True,
            o_bias=True,
            attn_sinks=True,
            sliding_window=8,
            window_layers=(0, 2),
            rope_theta=150000.0,
            rope_scaling=RopeScaling(
                "yarn",
                32.0,
                original_max_position_embeddings=64,
                truncate=False,
                attention_factor=yarn_attention_factor(32.0),
            ),
            moe=MoESpec(
                num_experts=8,
                top_k=2,
                intermediate_size=64,
                norm_topk_prob=False,
                router="topk_softmax",
                router_bias=True,
                expert_bias=True,
                activation="swiglu_clamped",
                swiglu_limit=2.0,
            ),
        ),
        512,
        torch.float32,
    ),
    "tiny-gemma3": Preset(_tiny_gemma3(), 512, torch.float32),
    # Phi-4-mini's switches: fused q/k/v and gate/up in its checkpoints, partial rotary (0.75 of
    # each head), longrope switching to its long set past 32 tokens, no biases
    "tiny-phi3": Preset(
        _tiny(
            "Phi3ForCausalLM",
            partial_rotary_factor=0.75,
            rope_scaling=RopeScaling(
                "longrope",
                1.0,
                original_max_position_embeddings=32,
                attention_factor=phi3.longrope_attention_factor(512 / 32, 32),
                short_factor=(1.0, 1.05, 1.1, 1.3, 1.6, 2.0),
                long_factor=(1.0, 1.5, 2.5, 4.0, 6.0, 8.0),
            ),
        ),
        512,
        torch.float32,
    ),
    "tiny-qwen35": Preset(_tiny_qwen35("Qwen3_5ForCausalLM"), 512, torch.float32),
    # every layer sparse, with the sigmoid-gated shared expert
    "tiny-qwen35-moe": Preset(
        _tiny_qwen35(
            "Qwen3_5MoeForCausalLM",
            intermediate_size=64,
            moe=replace(_TINY_MOE, intermediate_size=64, shared_intermediate_size=96),
        ),
        512,
        torch.float32,
    ),
    "tiny-mixtral": Preset(
        _tiny("MixtralForCausalLM", tie_word_embeddings=False, moe=_TINY_MOE, intermediate_size=64),
        512,
        torch.float32,
    ),
}
# tiny-gpt-oss as OpenAI's checkpoints store it: the experts in MXFP4 blocks, the rest bfloat16
PRESETS["tiny-gpt-oss-mxfp4"] = Preset(
    replace(PRESETS["tiny-gpt-oss"].config, quant_method="mxfp4"), 512, torch.bfloat16
)


class UnknownPresetError(ValueError):
    """A preset name that is not in PRESETS."""


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UnknownPresetError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    p = PRESETS[name]
    return replace(p, config=replace(p.config, torch_dtype=str(p.dtype).removeprefix("torch.")))


def hot_rows(config: ModelConfig, printable_ids: list[int] | None) -> list[int]:
    """Which output rows are scaled up: the given (printable) token ids, else evenly spaced ids."""
    if printable_ids:
        return printable_ids[:HOT_ROWS]
    step = max(1, config.vocab_size // HOT_ROWS)
    return list(range(1, config.vocab_size, step))[:HOT_ROWS]


def random_weights(
    config: ModelConfig, seed: int, dtype: torch.dtype, hot: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """HF-named random weights, deterministic for (config, seed), each rounded to bfloat16."""
    g = torch.Generator().manual_seed(seed)
    D, L = config.hidden_size, config.num_hidden_layers
    hd, H, Hkv, F = (
        config.head_dim,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    )

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    def linear(out_f: int, in_f: int, scale: float = 1.0) -> torch.Tensor:
        return normal((out_f, in_f), scale / math.sqrt(in_f))

    w: dict[str, torch.Tensor] = {}
    out_std = LOGIT_STD / math.sqrt(D)  # a unit-rms hidden state gives logits of std LOGIT_STD
    embed = normal((config.vocab_size, D), out_std if config.tie_word_embeddings else 1.0)
    out_rows = hot if hot is not None else hot_rows(config, None)
    if config.tie_word_embeddings:
        embed[out_rows] *= HOT_SCALE
    w["model.embed_tokens.weight"] = embed
    residual_scale = 1.0 / math.sqrt(2 * L)
    shift = config.norm_weight_offset or 0.0  # Gemma's norms store w less it
    for i in range(L):
        p = f"model.layers.{i}."
        if config.is_linear(i):
            w.update(_deltanet_weights(p, config, linear, normal, residual_scale))
        w[p + "self_attn.q_proj.weight"] = linear(H * hd * (2 if config.attn_output_gate else 1), D)
        w[p + "self_attn.k_proj.weight"] = linear(Hkv * hd, D)
        w[p + "self_attn.v_proj.weight"] = linear(Hkv * hd, D)
        w[p + "self_attn.o_proj.weight"] = linear(D, H * hd, residual_scale)
        if config.qkv_bias:
            w[p + "self_attn.q_proj.bias"] = normal((H * hd,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((Hkv * hd,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((Hkv * hd,), 0.1)
        if config.o_bias:
            w[p + "self_attn.o_proj.bias"] = normal((D,), 0.1)
        if config.qk_norm:
            w[p + "self_attn.q_norm.weight"] = 1.0 + normal((hd,), 0.1) - shift
            w[p + "self_attn.k_norm.weight"] = 1.0 + normal((hd,), 0.1) - shift
        if config.attn_sinks:
            w[p + "self_attn.sinks"] = normal((H,), 1.0)
        if config.is_sparse(i):
            w.update(_expert_weights(p, config.moe, D, normal, residual_scale))
        else:
            w[p + "mlp.gate_proj.weight"] = linear(F, D)
            w[p + "mlp.up_proj.weight"] = linear(F, D)
            w[p + "mlp.down_proj.weight"] = linear(D, F, residual_scale)
        if config.mlp_bias and not config.is_sparse(i):
            for name, n in (("gate_proj", F), ("up_proj", F), ("down_proj", D)):
                w[p + f"mlp.{name}.bias"] = normal((n,), 0.1)
        w[p + "input_layernorm.weight"] = 1.0 + normal((D,), 0.1) - shift
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal((D,), 0.1) - shift
        if config.norm_placement == "sandwich":  # the post norms scale the blocks' outputs
            post = residual_scale * (1.0 + normal((D,), 0.1))
            w[p + "post_attention_layernorm.weight"] = post - shift
            w[p + "pre_feedforward_layernorm.weight"] = 1.0 + normal((D,), 0.1) - shift
            w[p + "post_feedforward_layernorm.weight"] = (
                residual_scale * (1.0 + normal((D,), 0.1)) - shift
            )
    if config.deltanet is not None:  # a linear layer holds no self_attn
        w = {k: v for k, v in w.items() if not _attn_of_linear(config, k)}
    if config.tie_word_embeddings:
        signs = torch.randint(0, 2, (D,), generator=g).float() * 2 - 1
        w["model.norm.weight"] = signs - shift
    else:
        w["model.norm.weight"] = 1.0 + normal((D,), 0.1) - shift
        head = normal((config.vocab_size, D), out_std)
        head[out_rows] *= HOT_SCALE
        w["lm_head.weight"] = head
    return {k: v.to(torch.bfloat16).to(dtype).contiguous() for k, v in w.items()}


ROUTER_STD = 1.5  # std of a router logit on a unit-rms input: decisive, context-dependent routing


def _expert_weights(p: str, spec: MoESpec, D: int, normal, residual_scale: float) -> dict:
    """A sparse layer's router and experts, each expert a SwiGLU at the dense MLP's scales."""
    E, W = spec.num_experts, spec.intermediate_size
    w = {p + "mlp.gate.weight": normal((E, D), ROUTER_STD / math.sqrt(D))}
    w[p + "mlp.experts.gate_proj.weight"] = normal((E, W, D), 1 / math.sqrt(D))
    w[p + "mlp.experts.up_proj.weight"] = normal((E, W, D), 1 / math.sqrt(D))
    w[p + "mlp.experts.down_proj.weight"] = normal((E, D, W), residual_scale / math.sqrt(W))
    if spec.router_bias:
        w[p + "mlp.gate.bias"] = normal((E,), 0.5)
    if spec.expert_bias:
        for name, shape in (("gate_proj", (E, W)), ("up_proj", (E, W)), ("down_proj", (E, D))):
            w[p + f"mlp.experts.{name}.bias"] = normal(shape, 0.1)
    if spec.shared_intermediate_size:
        S = spec.shared_intermediate_size
        w[p + "mlp.shared_expert.gate_proj.weight"] = normal((S, D), 1 / math.sqrt(D))
        w[p + "mlp.shared_expert.up_proj.weight"] = normal((S, D), 1 / math.sqrt(D))
        w[p + "mlp.shared_expert.down_proj.weight"] = normal((D, S), residual_scale / math.sqrt(S))
        w[p + "mlp.shared_expert_gate.weight"] = normal((1, D), 1 / math.sqrt(D))
    return w


def _attn_of_linear(config: ModelConfig, name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 3 and parts[3] == "self_attn" and config.is_linear(int(parts[2]))


def _deltanet_weights(p: str, config: ModelConfig, linear, normal, residual_scale: float) -> dict:
    """A Gated DeltaNet layer's weights: projections at std 1/sqrt(fan_in), conv taps of std
    1/sqrt(K) (a unit-scale input stays unit-scale), decays A = exp(A_log) in [1, 8] and dt_bias
    near 0 (a state that forgets within a few to tens of tokens)."""
    s = config.deltanet
    D, Hv, K = config.hidden_size, s.num_value_heads, s.conv_kernel
    q = p + "linear_attn."
    return {
        q + "in_proj_qkv.weight": linear(s.conv_dim, D),
        q + "in_proj_z.weight": linear(Hv * s.value_head_dim, D),
        q + "in_proj_b.weight": linear(Hv, D),
        q + "in_proj_a.weight": linear(Hv, D),
        q + "conv1d.weight": normal((s.conv_dim, 1, K), 1 / math.sqrt(K)),
        q + "A_log": torch.linspace(0.0, math.log(8.0), Hv) + normal((Hv,), 0.05),
        q + "dt_bias": normal((Hv,), 0.5),
        q + "norm.weight": 1.0 + normal((s.value_head_dim,), 0.1),
        q + "out_proj.weight": linear(D, Hv * s.value_head_dim, residual_scale),
    }
