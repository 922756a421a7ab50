"""Model directories: presets written in HF layout, read back lazily, by slice, sharded or not."""

import json
import shutil

import pytest
import torch

from tandem.loaders.errors import CorruptFileError
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir
from tandem.loaders.tokenizer import StreamDecoder, Tokenizer
from tandem.models.presets import PRESETS


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "tiny-qwen3"
    make_model_dir(d, "tiny-qwen3", seed=3)
    return d


def test_make_model_is_deterministic_for_a_seed(tmp_path, qwen_dir):
    make_model_dir(tmp_path / "a", "tiny-qwen3", seed=3)
    make_model_dir(tmp_path / "b", "tiny-qwen3", seed=4)
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / f).read_bytes() == (qwen_dir / f).read_bytes()
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != (
        qwen_dir / "model.safetensors"
    ).read_bytes()


def test_every_preset_config_round_trips_through_config_json(tmp_path):
    for name, preset in PRESETS.items():
        if not name.startswith("tiny-"):
            continue  # the real shapes (qwen3-0.6b, qwen3-1.7b) take seconds and GBs to make
        make_model_dir(tmp_path / name, name, seed=0)
        cfg = ModelDir(tmp_path / name).config
        assert cfg.architecture == preset.config.architecture
        assert cfg.rope_scaling == preset.config.rope_scaling
        assert cfg.tie_word_embeddings == preset.config.tie_word_embeddings


def test_sharded_directory_loads_the_same_model_as_a_single_file(tmp_path, qwen_dir):
    make_model_dir(tmp_path / "s", "tiny-qwen3", seed=3, shard_bytes=40_000)
    md = ModelDir(tmp_path / "s")
    assert len({i.file for i in md.manifest.values()}) > 2
    a = load_model(md).state_dict()
    b = load_model(ModelDir(qwen_dir)).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_slice_read_returns_exactly_the_requested_rows_and_columns(qwen_dir):
    md = ModelDir(qwen_dir)
    name = "model.layers.1.mlp.gate_proj.weight"
    full = md.read(name)
    assert torch.equal(md.read(name, dim=0, start=32, end=96), full[32:96])
    assert torch.equal(md.read(name, dim=1, start=8, end=24), full[:, 8:24])


def test_tied_head_shares_the_embedding_and_a_head_only_stage_reads_it(qwen_dir):
    md = ModelDir(qwen_dir)
    m = load_model(md)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    last = load_model(md, layer_range=(1, 2), with_embed=False)
    assert torch.equal(last.lm_head.weight, m.model.embed_tokens.weight)
    assert list(last.model.layers) == ["1"]


def test_load_casts_to_the_requested_dtype(qwen_dir):
    m = load_model(ModelDir(qwen_dir), dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}


def test_fingerprint_depends_on_config_and_manifest(tmp_path, qwen_dir):
    make_model_dir(tmp_path / "l", "tiny-llama", seed=3)
    make_model_dir(tmp_path / "q", "tiny-qwen3", seed=9)  # other weights, same manifest
    fq = ModelDir(qwen_dir).fingerprint()
    assert fq == ModelDir(tmp_path / "q").fingerprint()
    assert fq != ModelDir(tmp_path / "l").fingerprint()


def test_tokenizer_round_trips_text_and_renders_chatml(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    text = "Hello, world! The quick brown fox."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == (2,)
    dec = StreamDecoder(tok)
    assert "".join(dec.push(i) for i in tok.encode("naïve café")) == "naïve café"


def test_generation_config_eos_ids_also_stop_and_a_corrupt_one_is_named(tmp_path, qwen_dir):
    """transformers stops on generation_config.json's eos_token_id list (gpt-oss: <|return|>,
    <|endoftext|>, <|call|>); ids outside the vocabulary are not kept."""
    d = tmp_path / "m"
    shutil.copytree(qwen_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 10**9]}))
    assert Tokenizer.from_dir(d).eos_token_ids == (2, 0)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Tokenizer.from_dir(d).eos_token_ids == (2, 1)
    (d / "generation_config.json").write_text("[")
    with pytest.raises(CorruptFileError, match="generation_config.json"):
        Tokenizer.from_dir(d)


def test_directory_without_tokenizer_is_accepted(tmp_path):
    make_model_dir(tmp_path / "u", "tiny-qwen3-untied", seed=0)
    assert Tokenizer.from_dir(tmp_path / "u") is None
    md = ModelDir(tmp_path / "u")
    assert json.loads((tmp_path / "u" / "config.json").read_text())["tie_word_embeddings"] is False
    m = load_model(md)
    assert m.lm_head.weight is not m.model.embed_tokens.weight
