"""Hostile or broken GGUF files are refused with a typed error naming the file (and the tensor, and
what was expected), within bounded time and memory."""

import struct
import time
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from tandem.loaders.gguf.config import GGUFArchitectureError, GGUFMetadataError
from tandem.loaders.gguf.model_file import GGUFMissingTensorError, GGUFModel, GGUFShapeError
from tandem.loaders.gguf.reader import (
    GGUFCorruptError,
    GGUFError,
    GGUFOverlapError,
    GGUFTensorTypeError,
)
from tandem.loaders.gguf.writer import write_gguf, write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import CorruptFileError, MissingTensorError, ModelFileError
from tandem.models.presets import get_preset, random_weights

MAX_PEAK_BYTES = 16 * 1024 * 1024  # what a hostile header may cost in Python memory, at most


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    _, (f,) = write_preset_gguf(d / "m.gguf", "tiny-llama", "Q8_0")
    load_model(GGUFModel(f))  # first-use imports and caches, so peaks below measure the file alone
    return f.read_bytes(), GGUFReader(f)


def refused(tmp_path, data: bytes, error: type, match: str):
    """Opens `data` as a GGUF file (then builds the model from it): the typed error, the header
    parse within MAX_PEAK_BYTES of Python memory, all of it within seconds (no runaway loop)."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    t0 = time.monotonic()
    with pytest.raises(error, match=match) as info:
        tracemalloc.start()
        try:
            src = GGUFModel(p)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        load_model(src)
    assert time.monotonic() - t0 < 30.0
    assert peak < MAX_PEAK_BYTES, peak
    assert isinstance(info.value, GGUFError) and isinstance(info.value, ModelFileError)
    assert str(p) in str(info.value)
    return info.value


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    n = struct.calcsize(fmt)
    return data[:offset] + struct.pack(fmt, value) + data[offset + n :]


def kv_value_offset(reader: GGUFReader, key: str) -> int:
    """Byte offset of a key's value (after its key string and type)."""
    return reader.fields[key].offset + 8 + len(key) + 4


def tensor_info_offsets(reader: GGUFReader, name: str) -> tuple[int, int]:
    """(type id offset, data offset offset) in a tensor's info entry."""
    t = next(t for t in reader.tensors if t.name == name)
    type_at = t.field.offset + 8 + len(name) + 4 + 8 * len(t.shape)
    return type_at, type_at + 4


def test_truncated_file_is_refused_naming_the_tensor_past_the_end(tmp_path, good):
    data, _ = good
    e = refused(
        tmp_path, data[:-100], GGUFCorruptError, r"tensor 'output_norm.weight' .* truncated"
    )
    assert isinstance(e, CorruptFileError)
    refused(tmp_path, data[:20], GGUFCorruptError, "too short for a GGUF header")
    refused(tmp_path, data[:1000], GGUFCorruptError, r"claims 512 elements; .*\(truncated\?\)")


def test_a_tensor_offset_past_the_end_is_refused_naming_the_tensor(tmp_path, good):
    data, reader = good
    _, at = tensor_info_offsets(reader, "blk.0.attn_v.weight")
    bad = patched(data, at, "<Q", 1 << 40)
    refused(
        tmp_path, bad, GGUFCorruptError, r"tensor 'blk.0.attn_v.weight' .*\(offset past the end"
    )
    refused(tmp_path, patched(data, at, "<Q", 33), GGUFCorruptError, "not a multiple of 32")


def test_two_tensors_over_the_same_bytes_are_refused_naming_both(tmp_path, good):
    """blk.0.attn_v pointed into blk.0.attn_k's bytes (same type and shape: everything else about
    the file is sound) loaded and gave nonsense with exit 0."""
    data, reader = good
    k = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    _, at = tensor_info_offsets(reader, "blk.0.attn_v.weight")
    rel = k.data_offset - reader.data_offset
    for shift in (0, 32):  # the same range, and one starting inside it
        e = refused(tmp_path, patched(data, at, "<Q", rel + shift), GGUFOverlapError, "overlap")
        assert "'blk.0.attn_k.weight'" in str(e) and "'blk.0.attn_v.weight'" in str(e)
        assert isinstance(e, GGUFCorruptError)


@pytest.mark.parametrize("where", ["tensor_count", "kv_count", "array_length", "dims"])
def test_a_count_of_2_to_the_63_is_refused_before_anything_is_allocated(tmp_path, good, where):
    data, reader = good
    at = {
        "tensor_count": 8,
        "kv_count": 16,
        "array_length": kv_value_offset(reader, "tokenizer.ggml.token_type") + 4,
        "dims": next(t for t in reader.tensors if t.name == "token_embd.weight").field.offset
        + 8 + len("token_embd.weight") + 4,
    }[where]  # fmt: skip
    refused(tmp_path, patched(data, at, "<Q", 1 << 63), GGUFCorruptError, str(1 << 63) + "|past")


def test_a_type_id_that_does_not_exist_is_refused_naming_the_tensor(tmp_path, good):
    data, reader = good
    at, _ = tensor_info_offsets(reader, "blk.1.ffn_up.weight")
    e = refused(
        tmp_path, patched(data, at, "<I", 4242), GGUFTensorTypeError, "'blk.1.ffn_up.weight'.*4242"
    )
    assert "does not exist" in str(e)


def test_a_type_tandem_does_not_read_is_refused_naming_the_tensor_and_the_types_it_reads(
    tmp_path, good
):
    data, reader = good
    at, _ = tensor_info_offsets(reader, "output_norm.weight")  # F32 -> I32: same bytes
    refused(
        tmp_path,
        patched(data, at, "<I", 26),
        GGUFTensorTypeError,
        r"'output_norm.weight' is of type I32 \(id 26\); tandem reads F32, F16",
    )


def test_metadata_strings_of_absurd_length_are_refused(tmp_path, good):
    data, reader = good
    at = kv_value_offset(reader, "general.name")
    refused(
        tmp_path, patched(data, at, "<Q", 1 << 40), GGUFCorruptError, "claims 1099511627776 bytes"
    )
    key_at = reader.fields["general.name"].offset  # the key's own length
    refused(tmp_path, patched(data, key_at, "<Q", (1 << 63) + 5), GGUFCorruptError, "string")
    at = kv_value_offset(reader, "tokenizer.ggml.tokens") + 12  # the first token's length
    refused(tmp_path, patched(data, at, "<Q", 1 << 30), GGUFCorruptError, "past the end|claims")


def test_bad_magic_and_version_are_refused(tmp_path, good):
    data, _ = good
    refused(tmp_path, b"GGUX" + data[4:], GGUFCorruptError, "magic")
    refused(tmp_path, patched(data, 4, "<I", 99), GGUFCorruptError, "version 99")


def test_another_architecture_is_refused_naming_it_and_the_supported_ones(tmp_path):
    p = tmp_path / "mamba.gguf"
    w = GGUFWriter(p, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFArchitectureError, match=r"'mamba' is not supported; supported: llama"):
        GGUFModel(p)


def _write(tmp_path, edit, **kw):
    cfg = get_preset("tiny-qwen3").config
    tensors = random_weights(cfg, 0, torch.float32)
    cfg = edit(cfg, tensors) or cfg
    (f,) = write_gguf(tmp_path / "m.gguf", cfg, tensors, **kw)
    return f


def test_a_missing_tensor_is_refused_naming_the_gguf_and_model_names(tmp_path):
    f = _write(tmp_path, lambda c, t: t.pop("model.layers.1.mlp.up_proj.weight", None) is None)
    with pytest.raises(GGUFMissingTensorError, match=r"no tensor 'blk.1.ffn_up.weight'") as e:
        load_model(GGUFModel(f))
    assert isinstance(e.value, MissingTensorError) and str(f) in str(e.value)


def test_a_shape_that_disagrees_with_the_metadata_is_refused_naming_both(tmp_path):
    def narrow(c, t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:96]

    f = _write(tmp_path, narrow)
    with pytest.raises(GGUFShapeError, match=r"'blk.0.ffn_up.weight' has shape \[96, 64\], the "
                       r"metadata implies \[128, 64\]"):  # fmt: skip
        load_model(GGUFModel(f))


def test_a_tensor_the_architecture_has_no_place_for_is_refused(tmp_path):
    p = _write(tmp_path, lambda c, t: None)
    data = p.read_bytes()
    reader = GGUFReader(p)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight")
    at = t.field.offset + 8  # rename it to an unknown tensor of the same length
    (tmp_path / "bad.gguf").write_bytes(data[:at] + b"blk.0.attn_x_norm.weight" + data[at + 24 :])
    with pytest.raises(GGUFArchitectureError, match="'blk.0.attn_x_norm.weight' have no place"):
        GGUFModel(tmp_path / "bad.gguf")
    # q/k norms are known names, but a llama model has no place for them either
    cfg = get_preset("tiny-llama").config
    tensors = random_weights(replace(cfg, qk_norm=True), 0, torch.float32)
    (f,) = write_gguf(tmp_path / "l.gguf", cfg, tensors)
    with pytest.raises(GGUFArchitectureError, match="'blk.0.attn_q_norm.weight'.* in a llama"):
        GGUFModel(f)


def test_metadata_that_lies_about_the_layer_count_or_lacks_a_field_is_refused(tmp_path, good):
    data, reader = good
    at = kv_value_offset(reader, "llama.block_count")
    (tmp_path / "b.gguf").write_bytes(patched(data, at, "<I", 1_000_000))
    with pytest.raises(GGUFMetadataError, match="block_count 1000000 but the file holds"):
        GGUFModel(tmp_path / "b.gguf")
    key = reader.fields["llama.context_length"].offset + 8  # rename the key: now absent
    (tmp_path / "c.gguf").write_bytes(data[:key] + b"llama.context_lengtx" + data[key + 20 :])
    with pytest.raises(GGUFMetadataError, match="'llama.context_length' is missing"):
        GGUFModel(tmp_path / "c.gguf")
