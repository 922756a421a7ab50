"""Model families as declarations (`tandem.models.families`): every preset's config survives
config.json and GGUF metadata through its family's declaration unchanged; transformers reads the
config.json a declaration writes as that family; lookups resolve GGUF architectures (a `llama` file
with experts is Mixtral) and name the supported families when they refuse one."""

from dataclasses import replace

import numpy as np
import pytest
import transformers

from tandem.config import ConfigError, ModelConfig, UnsupportedArchitectureError
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models import families
from tandem.models.families import gemma3
from tandem.models.presets import PRESETS

FAMILY_PRESETS = [n for n in PRESETS if n.startswith("tiny-")]


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_config_json_round_trips_through_the_familys_declaration(name):
    config = PRESETS[name].config
    d = config.to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == config
    hf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    assert type(hf).model_type == config.model_type == config.family.model_type


@pytest.mark.parametrize(
    "name",
    [
        "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe",
        "tiny-mixtral", "tiny-gpt-oss", "tiny-qwen35", "tiny-qwen35-moe",
    ],
)  # fmt: skip
def test_gguf_metadata_round_trips_through_the_familys_declaration(name, tmp_path):
    config = PRESETS[name].config
    _, (file,) = write_preset_gguf(tmp_path / "m.gguf", name, "F32")
    got = GGUFModel(file).config
    assert got.family is config.family
    # what GGUF files do not carry (`test_gguf_loader`): eps beyond float32, the dtype the weights
    # came in, eos ids beyond the tokenizer's; gpt-oss's SwiGLU constants and YaRN's truncated
    # corrections are llama.cpp's own
    want = replace(
        config, rms_norm_eps=float(np.float32(config.rms_norm_eps)), torch_dtype="float32",
        eos_token_ids=got.eos_token_ids, bos_token_id=got.bos_token_id,
    )  # fmt: skip
    if config.moe is not None and config.moe.activation == "swiglu_clamped":
        moe = replace(config.moe, swiglu_alpha=1.702, swiglu_limit=7.0)
        want = replace(want, moe=moe, rope_scaling=replace(config.rope_scaling, truncate=True))
    if config.deltanet is not None:  # a qwen35 file stores tiled v heads, A itself and 1 + w
        spec = replace(config.deltanet, v_tiled=True, a_log=False)
        want = replace(want, deltanet=spec, norm_weight_offset=0.0)
    assert got == want


def _rewritten(src, dst, arch: str, edit: dict):
    """GGUF `src` copied to `dst` with the keys in `edit` replaced by its values (None: dropped)."""
    import gguf

    reader, w = gguf.GGUFReader(src), gguf.GGUFWriter(dst, arch)
    for k, f in reader.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or edit.get(k, 0) is None:
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(k, edit.get(k, f.contents()), f.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def test_a_qwen35_files_layer_pattern_is_a_bool_per_layer_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's converter writes `qwen35.attention.recurrent_layers` (a bool per layer, from
    layer_types) and llama.cpp reads it before `full_attention_interval`: tandem writes it for
    every pattern (the interval too where the pattern is one) and reads it first, so a pattern
    that is not every n-th layer round-trips; a list of the wrong length is refused."""
    import gguf

    config = PRESETS["tiny-qwen35"].config
    for linear, interval in (((0, 1, 2), 4), ((0, 2, 3), None)):
        c = replace(config, deltanet=replace(config.deltanet, linear_layers=linear))
        _, (file,) = write_preset_gguf(tmp_path / f"{linear}.gguf", "tiny-qwen35", "F32", config=c)
        fields = gguf.GGUFReader(file).fields
        assert fields["qwen35.attention.recurrent_layers"].contents() == [
            i in linear for i in range(4)
        ]
        stated = fields.get("qwen35.full_attention_interval")
        assert (stated.contents() if stated else None) == interval
        assert GGUFModel(file).config.deltanet.linear_layers == linear
    short = {"qwen35.attention.recurrent_layers": [True, False]}
    bad = _rewritten(file, tmp_path / "short.gguf", "qwen35", short)
    with pytest.raises(ConfigError, match="recurrent_layers has 2 values for 4 layers"):
        GGUFModel(bad)


def test_a_qwen35moe_file_without_a_dense_ffn_width_reads_as_the_converter_writes_it(tmp_path):
    """llama.cpp's converter writes no `feed_forward_length` for qwen35moe (every layer sparse:
    Qwen3.5-MoE's config has no dense width): such a file reads as the one stating it; a dense
    qwen35 file without it is still refused by the key's name."""
    for name, arch in (("tiny-qwen35-moe", "qwen35moe"), ("tiny-qwen35", "qwen35")):
        _, (file,) = write_preset_gguf(tmp_path / f"{name}.gguf", name, "F32")
        drop = {f"{arch}.feed_forward_length": None}
        bare = _rewritten(file, tmp_path / f"{name}-bare.gguf", arch, drop)
        if arch == "qwen35moe":
            assert GGUFModel(bare).config == GGUFModel(file).config
        else:
            with pytest.raises(ConfigError, match="feed_forward_length"):
                GGUFModel(bare)


def test_a_qwen2moe_file_renormalises_the_top_k_only_where_it_says_so(tmp_path):
    """llama.cpp never renormalises qwen2moe's top k, so a file stating no expert_weights_norm
    reads with it off; a Qwen2-MoE with norm_topk_prob on is written saying so."""
    config = PRESETS["tiny-qwen2-moe"].config
    for norm in (False, True):
        c = replace(config, moe=replace(config.moe, norm_topk_prob=norm))
        _, (file,) = write_preset_gguf(tmp_path / f"{norm}.gguf", "tiny-qwen2-moe", "F32", config=c)
        src = GGUFModel(file)
        assert src.config.moe == c.moe
        stated = src.metadata.fields.get("qwen2moe.expert_weights_norm") is not None
        assert stated == norm


QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B's config.json, its shape and MoE fields
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
    "norm_topk_prob": False, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}  # fmt: skip


def test_qwen15_moe_reads_as_qwen2_moe_with_its_shared_expert_and_refuses_sliding_windows():
    """Qwen1.5-MoE-A2.7B: 60 experts of 1408, the top 4 not renormalised, a shared expert of
    5632 on every layer (sparse step 1), q/k/v biases by transformers' default; a sparse step
    of 2 leaves the odd-numbered layers (i + 1) % 2 != 0 dense; a sliding window is refused."""
    c = ModelConfig.from_hf_dict(QWEN15_MOE_A27B)
    assert c.family is families.qwen2_moe.FAMILY and c.qkv_bias and not c.o_bias
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.norm_topk_prob) == (60, 4, 1408, False)
    assert (m.shared_intermediate_size, m.dense_layers) == (5632, ())
    stepped = ModelConfig.from_hf_dict({**QWEN15_MOE_A27B, "decoder_sparse_step": 2})
    assert stepped.moe.dense_layers == tuple(range(0, 24, 2))
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**QWEN15_MOE_A27B, "use_sliding_window": True})


def test_lookups_and_refusals_name_the_families():
    assert families.by_gguf("llama", has_experts=True).architecture == "MixtralForCausalLM"
    assert families.by_gguf("llama", has_experts=False).architecture == "LlamaForCausalLM"
    assert families.by_gguf("qwen3moe", has_experts=True).architecture == "Qwen3MoeForCausalLM"
    assert families.by_gguf("qwen2moe", has_experts=True).architecture == "Qwen2MoeForCausalLM"
    assert families.by_gguf("mamba", has_experts=False) is None
    assert families.by_model_type("gpt_oss").architecture == "GptOssForCausalLM"
    archs = [a for f in families.FAMILIES for a in (f.architecture, *f.multimodal)]
    assert len(set(archs)) == len(archs) == len(families.supported_architectures())
    assert families.by_architecture("Gemma3ForConditionalGeneration") is gemma3.FAMILY
    with pytest.raises(UnsupportedArchitectureError, match="'MambaForCausalLM'.*LlamaForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["MambaForCausalLM"], "hidden_size": 8})
