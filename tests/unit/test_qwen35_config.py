"""The Qwen3.5 / Qwen3.6 family's config: a multimodal checkpoint's `text_config` (layer_types,
the linear_* head counts and dims, M-RoPE fields in rope_parameters, MTP and SSM-dtype fields
tandem does not read) parses into the hybrid's switches and survives config.json; the MoE
variant makes every layer sparse with its shared expert; absent layer_types follow
full_attention_interval; bad layer types and head counts are refused by name; a
`Qwen3_5ForConditionalGeneration` saved by transformers loads its text model equal to it."""

import pytest
import torch
from hf_init import spread_

from tandem.config import ConfigError, ConfigFieldError, ModelConfig

# shaped like a released Qwen3.6 multimodal config.json (its vision part left out)
QWEN36 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 8, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_interleaved": True, "mrope_section": [11, 11, 10],
        },
        "eos_token_id": 248044,
    },
}  # fmt: skip


def test_a_multimodal_text_config_parses_into_the_hybrids_switches():
    c = ModelConfig.from_hf_dict(QWEN36)
    assert c.architecture == "Qwen3_5ForCausalLM" and c.hybrid
    assert c.deltanet.linear_layers == (0, 1, 2, 4, 5, 6)
    s = c.deltanet
    assert (s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim) == (
        16,
        48,
        128,
        128,
    )
    assert s.conv_kernel == 4 and s.conv_dim == 2 * 16 * 128 + 48 * 128
    assert c.rotary_dim == 64 and c.rope_theta == 1e7 and c.rope_scaling is None
    assert c.qk_norm and c.attn_output_gate and c.norm_weight_offset == 1.0
    assert c.eos_token_ids == (248044,) and c.moe is None
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_the_moe_variant_is_sparse_everywhere_with_its_shared_expert():
    d = {
        "architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 1000,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    }  # fmt: skip
    c = ModelConfig.from_hf_dict(d)
    assert c.deltanet.linear_layers == (0, 1, 2)  # full_attention_interval 4 by default
    assert all(c.is_sparse(i) for i in range(4)) and c.moe.norm_topk_prob
    assert c.moe.shared_intermediate_size == 512 and c.intermediate_size == 512
    assert "intermediate_size" not in c.to_hf_dict()  # transformers' config has none
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_bad_layer_types_and_head_counts_are_refused_by_name():
    text = QWEN36["text_config"]
    bad = {**QWEN36, "text_config": {**text, "layer_types": ["linear_attention", "mamba"] * 4}}
    with pytest.raises(ConfigError, match="'mamba'"):
        ModelConfig.from_hf_dict(bad)
    bad = {
        **QWEN36,
        "text_config": {**text, "linear_num_value_heads": 40, "linear_num_key_heads": 16},
    }
    with pytest.raises(ConfigFieldError, match="linear_num_value_heads"):
        ModelConfig.from_hf_dict(bad)


@torch.inference_mode()
def test_a_multimodal_checkpoint_loads_its_text_model_equal_to_transformers(tmp_path):
    """A Qwen3_5ForConditionalGeneration saved by transformers (text weights under
    `model.language_model.`, a vision tower beside them): its text model's logits."""
    import transformers

    from tandem.loaders.load import load_model
    from tandem.loaders.safetensors_dir import ModelDir

    text = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = spread_(transformers.Qwen3_5ForConditionalGeneration(cfg).eval(), matrix_std=0.25)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    md = ModelDir(tmp_path)
    assert md.config.architecture == "Qwen3_5ForCausalLM"
    ids = torch.tensor([[5, 17, 33, 2, 8, 100, 7]])
    torch.testing.assert_close(load_model(md)(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=0)
