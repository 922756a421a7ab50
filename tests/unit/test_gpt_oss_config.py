"""gpt-oss's config.json as transformers writes it parses into tandem's switches: sinks, the
sliding window on the layers `layer_types` names (every even layer by default), attention biases by
default, YaRN with transformers' attention factor, the MoE spec (top-k then softmax, biased router
and experts, the clamped SwiGLU's alpha and limit); and bad values are typed errors."""

import math

import pytest
import transformers

from tandem.config import ConfigError, ConfigFieldError, ModelConfig
from tandem.models.presets import get_preset
from tandem.models.rope import RotaryEmbedding


def _hf(**kw) -> dict:
    cfg = transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=6, **kw,
    )  # fmt: skip
    return cfg.to_dict() | {"architectures": ["GptOssForCausalLM"]}


def test_transformers_gpt_oss_config_parses_into_tandems_switches():
    c = ModelConfig.from_hf_dict(_hf(swiglu_limit=5.0))
    assert c.attn_sinks and c.qkv_bias and c.o_bias and not c.qk_norm
    assert [c.window(i) for i in range(4)] == [6, None, 6, None]
    assert c.rope_theta == 150000.0 and c.rope_scaling.rope_type == "yarn"
    assert c.rope_scaling.factor == 32.0 and c.rope_scaling.truncate is False
    assert c.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1.0)
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size) == (6, 2, 48)
    assert (m.router, m.router_bias, m.expert_bias) == ("topk_softmax", True, True)
    assert (m.activation, m.swiglu_alpha, m.swiglu_limit) == ("swiglu_clamped", 1.702, 5.0)
    assert m.dense_layers == ()
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_yarn_frequencies_and_scale_equal_transformers():
    hf = transformers.GptOssConfig(head_dim=16, max_position_embeddings=256)
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    ref = GptOssRotaryEmbedding(hf)
    ours = RotaryEmbedding(
        ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    )
    assert torch.equal(ours.inv_freq, ref.inv_freq)
    assert ours.scale == ref.attention_scaling
    # the tables: angles (position x inv_freq), cos/sin scaled by the factor. Not against
    # transformers' forward, whose float32 table at positions ~300 differed by up to 2e-4 between
    # identical processes on this machine (its own numerics, not its frequencies)
    pos = torch.arange(300)[None]
    angles = pos[..., None].float() * ref.inv_freq  # (1, 300, 8)
    our_cos, our_sin = ours(pos, torch.float32)
    assert torch.equal(our_cos[0, :, 0, :8], angles[0].cos() * ref.attention_scaling)
    assert torch.equal(our_sin[0, :, 0, 8:], angles[0].sin() * ref.attention_scaling)


def test_bad_layer_types_and_activation_bounds_are_typed_errors():
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf_dict(_hf() | {"layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf_dict(_hf() | {"layer_types": ["chunked"] * 4})
    rope = _hf()["rope_parameters"]
    for field in ("beta_fast", "attention_factor"):
        with pytest.raises(ConfigFieldError, match=f"rope_scaling.{field}"):
            ModelConfig.from_hf_dict(_hf() | {"rope_parameters": rope | {field: 1e9}})
    with pytest.raises(ConfigFieldError, match="swiglu_limit"):
        ModelConfig.from_hf_dict(_hf() | {"swiglu_limit": 0.0})


def test_the_preset_round_trips_through_its_config_json():
    c = get_preset("tiny-gpt-oss").config
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
