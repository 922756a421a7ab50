"""A `gemma3` GGUF as llama.cpp's converter writes it and llama.cpp reads it
(`models.families.gemma3`): norms stored as 1 + w under gemma3's own names, the window's layer
pattern (6 when unstated, else a bool per layer) and local rope base, llama.cpp's attention scale
(hidden / heads for the 62-layer 27B); what a file cannot state or tandem does not run is a typed
error."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from gguf import GGUFReader

from tandem.loaders.gguf.config import GGUFArchitectureError
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.tensor_types import GGUFWriteError
from tandem.loaders.gguf.writer import write_gguf, write_preset_gguf
from tandem.models.families import gemma3
from tandem.models.presets import get_preset, random_weights

GGUF_SHAPE = dict(query_pre_attn_scalar=None)  # head_dim's scale: what llama.cpp derives


def _config(**kw):
    return replace(get_preset("tiny-gemma3").config, **{**GGUF_SHAPE, **kw})


def test_norms_are_stored_as_one_plus_w_under_gemma3s_names(tmp_path):
    config = _config()
    weights = random_weights(config, 0, torch.float32)
    (file,) = write_gguf(tmp_path / "g.gguf", config, weights, qtype="Q8_0")
    names = {t.name for t in GGUFReader(file).tensors}
    for own in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
        assert f"blk.0.{own}.weight" in names
    src = GGUFModel(file)
    assert src.config.norm_weight_offset == 0.0
    for name in (
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.3.post_feedforward_layernorm.weight",
        "model.layers.6.self_attn.q_norm.weight",
        "model.norm.weight",
    ):
        got = torch.from_numpy(src.values_array(name))
        assert torch.equal(got, weights[name] + 1.0), name


def test_a_pattern_other_than_5_to_1_and_a_local_base_round_trip(tmp_path):
    config = _config(window_layers=(0, 2, 4, 6), rope_local_theta=20000.0)
    _, (file,) = write_preset_gguf(tmp_path / "g.gguf", "tiny-gemma3", "Q8_0", config=config)
    c = GGUFModel(file).config
    assert c.window_layers == (0, 2, 4, 6) and c.rope_local_theta == 20000.0
    assert c.rope_scaling == config.rope_scaling and c.embed_scale == 8.0
    _, (plain,) = write_preset_gguf(tmp_path / "p.gguf", "tiny-gemma3", "Q8_0", config=_config())
    c = GGUFModel(plain).config
    assert c.window_layers == (0, 1, 2, 3, 4, 6) and c.rope_local_theta == 10000.0


def test_llama_cpps_attention_scale_reads_hidden_over_heads_only_for_the_27b():
    def meta(layers: int) -> SimpleNamespace:
        kv = {
            "gemma3.block_count": layers, "gemma3.embedding_length": 5376,
            "gemma3.attention.head_count": 32, "gemma3.attention.sliding_window": 1024,
        }  # fmt: skip
        return SimpleNamespace(
            file="f.gguf", count=lambda k: None, get=lambda k, kind, d=None: kv.get(k, d)
        )

    def fields(layers: int) -> dict:
        return gemma3.gguf_fields(SimpleNamespace(meta=meta(layers), a="gemma3.", tensors=()))

    assert fields(62)["query_pre_attn_scalar"] == 168.0
    assert fields(34)["query_pre_attn_scalar"] is None
    assert fields(34)["window_layers"][:6] == (0, 1, 2, 3, 4, 6)


def test_what_a_file_cannot_state_or_tandem_does_not_run_is_refused(tmp_path, monkeypatch):
    with pytest.raises(GGUFWriteError, match="query_pre_attn_scalar"):
        write_preset_gguf(tmp_path / "s.gguf", "tiny-gemma3", "Q8_0")  # its scalar is 24
    real = gemma3.gguf_kv
    capped = lambda c: {**real(c), "final_logit_softcapping": ("float32", 30.0)}  # noqa: E731
    monkeypatch.setattr(gemma3, "gguf_kv", capped)
    _, (file,) = write_preset_gguf(tmp_path / "c.gguf", "tiny-gemma3", "Q8_0", config=_config())
    with pytest.raises(GGUFArchitectureError, match="soft-capping"):
        GGUFModel(file)


def test_a_safetensors_gemma_quantized_in_memory_loads_with_its_own_norms(tmp_path):
    """`--quantize q8_0` on an HF directory: matrices in blocks, norms as HF stores them (w,
    offset 1); the logits stay within Q8_0's error of the float model's."""
    from tandem.loaders.gguf.quantized_dir import QuantizedModelDir
    from tandem.loaders.load import load_model
    from tandem.loaders.make import make_model_dir
    from tandem.loaders.safetensors_dir import ModelDir

    make_model_dir(tmp_path / "m", "tiny-gemma3")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    with torch.no_grad():
        want = load_model(ModelDir(tmp_path / "m"))(ids)
        got = load_model(QuantizedModelDir(ModelDir(tmp_path / "m"), "q8_0"))(ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
