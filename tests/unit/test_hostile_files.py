"""Hostile or broken model files are refused with a typed error naming the file and tensor."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tandem.config import ConfigError, UnsupportedArchitectureError
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import (
    CorruptFileError,
    MissingFileError,
    MissingTensorError,
    ModelDir,
    TensorDtypeError,
    TensorShapeError,
)
from tandem.loaders.tokenizer import Tokenizer


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "m"
    make_model_dir(d, "tiny-llama", seed=0)
    return d


def rewrite(model_dir, fn):
    sd = dict(ModelDir(model_dir).manifest)
    tensors = {k: ModelDir(model_dir).read(k) for k in sd}
    fn(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def test_truncated_safetensors_is_refused_naming_the_file_and_tensor(model_dir):
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CorruptFileError, match=r"model\.safetensors: tensor '.*' ends at byte"):
        ModelDir(model_dir)


def test_header_claiming_more_bytes_than_the_file_has_is_refused(model_dir):
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    with pytest.raises(CorruptFileError, match="header claims"):
        ModelDir(model_dir)


def test_garbage_header_and_tiny_file_are_refused(model_dir):
    f = model_dir / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    with pytest.raises(CorruptFileError, match="not a JSON object"):
        ModelDir(model_dir)
    f.write_bytes(b"abc")
    with pytest.raises(CorruptFileError, match="too short"):
        ModelDir(model_dir)


def test_offsets_that_disagree_with_dtype_and_shape_are_refused(model_dir):
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = "model.norm.weight"
    header[name]["shape"] = [header[name]["shape"][0] * 2]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    f.write_bytes(data[:8] + raw + data[8 + n :])
    with pytest.raises(CorruptFileError, match="model.norm.weight"):
        ModelDir(model_dir)


def test_config_missing_a_field_is_refused_naming_it(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json: required field 'num_hidden_layers'"):
        ModelDir(model_dir)


def test_bad_config_values_are_refused(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    for key, value in (("hidden_size", "64"), ("num_key_value_heads", 3), ("vocab_size", -1)):
        bad = dict(cfg, **{key: value})
        (model_dir / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            ModelDir(model_dir)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelDir(model_dir)


def test_unsupported_architecture_error_lists_the_supported_ones(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3ForCausalLM"):
        ModelDir(model_dir)


def test_missing_tensor_is_refused_naming_it(model_dir):
    rewrite(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(ModelDir(model_dir))


def test_wrong_shape_and_wrong_dtype_are_refused_naming_the_tensor(model_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite(model_dir, lambda t: t.__setitem__(name, t[name][:-1].contiguous()))
    with pytest.raises(TensorShapeError, match=name):
        load_model(ModelDir(model_dir))
    rewrite(
        model_dir,
        lambda t: t.__setitem__(name, torch.zeros(t[name].shape[0] + 1, 64, dtype=torch.int32)[1:]),
    )
    with pytest.raises(TensorDtypeError, match=name):
        load_model(ModelDir(model_dir))


def test_missing_weights_and_missing_shard_are_refused(tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(MissingFileError, match="model.safetensors"):
        ModelDir(model_dir)
    d = tmp_path / "sharded"
    make_model_dir(d, "tiny-llama", seed=0, shard_bytes=30_000)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(MissingFileError, match="model-00002"):
        ModelDir(d)


def test_corrupt_tokenizer_is_refused(model_dir):
    (model_dir / "tokenizer.json").write_text('{"model": 5}')
    with pytest.raises(CorruptFileError, match="tokenizer.json"):
        Tokenizer.from_dir(model_dir)
