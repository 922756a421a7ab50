"""Gemma 3's config.json parses into tandem's switches (`models.families.gemma3`): transformers'
own config (rope per layer type) and the old layout of the released checkpoints, the text model
of a `Gemma3ForConditionalGeneration` with transformers' defaults under what its `text_config`
omits, the 5:1 layer pattern; the variants it does not run are refused with a typed error."""

import pytest
import transformers

from tandem.config import ConfigError, ConfigFieldError, ModelConfig, UnsupportedArchitectureError
from tandem.models.families.gemma3 import Gemma3VariantError
from tandem.models.presets import get_preset

# google/gemma-3-1b-it's config.json (the fields it states)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "vocab_size": 262144,
}  # fmt: skip
# google/gemma-3-4b-it's config.json, its vision part left out
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
    "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}  # fmt: skip


def test_the_released_1b_config_parses_into_gemmas_switches():
    c = ModelConfig.from_hf_dict(GEMMA3_1B)
    assert (c.norm_placement, c.norm_weight_offset, c.mlp_activation) == (
        "sandwich",
        1.0,
        "gelu_tanh",
    )
    assert c.qk_norm and c.tie_word_embeddings and c.num_key_value_heads == 1
    assert c.embed_scale == pytest.approx(1152**0.5)
    assert c.attention_scale == 256**-0.5
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.rope_local_theta == 10000.0
    globals_ = [i for i in range(26) if c.window(i) is None]
    assert globals_ == [5, 11, 17, 23]  # 5 local : 1 global
    assert all(c.window(i) == 512 and c.rope_local(i) for i in range(26) if i not in globals_)
    assert not any(c.rope_local(i) for i in globals_)
    assert c.eos_token_ids == (1, 106) and c.bos_token_id == 2
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_the_4b_multimodal_config_gives_its_text_model_with_transformers_defaults():
    c = ModelConfig.from_hf_dict(GEMMA3_4B)
    assert c.architecture == "Gemma3ForCausalLM"
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (2560, 34, 262_208)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 256)
    assert c.rope_scaling.rope_type == "linear" and c.rope_scaling.factor == 8.0
    assert c.rope_theta == 1e6 and c.rope_local_theta == 10000.0
    assert c.sliding_window == 1024 and c.eos_token_ids == (1, 106)
    assert c.torch_dtype == "bfloat16"


def test_transformers_own_config_with_rope_per_layer_type_round_trips():
    hf = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=5e5),
            "sliding_attention": dict(rope_type="default", rope_theta=2e4),
        },
    )  # fmt: skip
    c = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    assert c.rope_theta == 5e5 and c.rope_local_theta == 2e4 and c.rope_scaling.factor == 8.0
    assert c.window_layers == (0, 1, 2, 3, 4, 6)
    assert c.query_pre_attn_scalar == 24.0
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    assert ModelConfig.from_hf_dict(get_preset("tiny-gemma3").config.to_hf_dict()).rope_local(6)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"final_logit_softcapping": 30.0}, Gemma3VariantError, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, Gemma3VariantError, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, Gemma3VariantError, "bidirectional"),
        ({"hidden_activation": "gelu"}, Gemma3VariantError, "hidden_activation"),
        ({"sliding_window": None}, ConfigError, "sliding_window"),
        ({"layer_types": ["full_attention"] * 3}, ConfigError, "layer_types"),
        ({"rope_local_base_freq": 0.5}, ConfigFieldError, "rope_local_theta"),
        ({"query_pre_attn_scalar": "x"}, ConfigError, "query_pre_attn_scalar"),
    ],
)
def test_variants_tandem_does_not_run_are_refused_with_a_typed_error(change, error, match):
    with pytest.raises(error, match=match):
        ModelConfig.from_hf_dict({**GEMMA3_1B, **change})
    assert issubclass(Gemma3VariantError, UnsupportedArchitectureError)


def test_family_switches_are_validated_on_direct_construction():
    import dataclasses

    base = get_preset("tiny-gemma3").config
    for change, field in (
        ({"norm_placement": "post"}, "norm_placement"),
        ({"mlp_activation": "relu"}, "mlp_activation"),
        ({"embed_scale": float("nan")}, "embed_scale"),
        ({"sliding_window": None, "window_layers": None}, "rope_local_theta"),
    ):
        with pytest.raises(ConfigFieldError, match=field):
            dataclasses.replace(base, **change)


def test_help_and_the_unsupported_architecture_error_name_gemma3():
    from tandem.cli.main import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "Gemma3ForCausalLM" in text and "gemma3" in text and "Gemma 3" in text
    with pytest.raises(UnsupportedArchitectureError, match="Gemma3ForConditionalGeneration"):
        ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"]})
