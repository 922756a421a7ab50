"""gpt-oss's MXFP4 safetensors layout (`loaders.mxfp4_layout`, `loaders.mxfp4_dir`): OpenAI's
blocks and scales repack into ggml's MXFP4 blocks that dequantize exactly as transformers
dequantizes the original bytes; a directory's experts load as those blocks, every slice a TP or
expert-parallel rank asks for reads only its own bytes of the file, and a quant method tandem does
not read is refused by name."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tandem.config import ConfigError, ModelConfig, UnsupportedQuantizationError
from tandem.loaders.gguf.quantized_dir import QuantizeChoiceError
from tandem.loaders.make import make_model_dir
from tandem.loaders.mxfp4_dir import (
    MXFP4,
    Mxfp4LayoutError,
    Mxfp4ModelDir,
    Mxfp4SliceError,
)
from tandem.loaders.mxfp4_layout import ggml_from_openai, openai_from_ggml
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.models.quant.dequant import dequantize


def _dequantized(q: np.ndarray) -> torch.Tensor:
    """ggml MXFP4 bytes (..., G * 17) -> float32 (..., G * 32)."""
    t = torch.from_numpy(q)
    return dequantize(t.reshape(-1, t.shape[-1]), MXFP4).view(*t.shape[:-1], -1)


def test_openai_blocks_repack_to_ggml_blocks_dequantizing_as_transformers_does():
    """Every code in both nibbles, every exponent byte 0..255 (subnormal scales, 2^127, the
    overflows to inf): tandem's dequantization of the repacked bytes equals transformers'
    `convert_moe_packed_tensors` of the original ones, and the repacking inverts exactly."""
    rng = np.random.default_rng(0)
    E, rows, groups = 2, 256, 3
    blocks = rng.integers(0, 256, (E, rows, groups, 16), dtype=np.uint8)
    blocks[0, :, 0] = np.arange(256, dtype=np.uint8)[:, None]  # every byte: both nibbles' codes
    scales = rng.integers(0, 256, (E, rows, groups), dtype=np.uint8)
    scales[0, :, 1] = np.arange(256, dtype=np.uint8)  # every exponent
    q = ggml_from_openai(blocks, scales)
    assert q.shape == (E, rows, groups * 17)
    theirs = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )  # (E, cols, rows): transformers holds the experts transposed
    assert torch.equal(_dequantized(q), theirs.transpose(1, 2))
    back = openai_from_ggml(q)
    assert np.array_equal(back[0], blocks) and np.array_equal(back[1], scales)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mxfp4") / "m"
    make_model_dir(d, "tiny-gpt-oss-mxfp4")
    return d


def test_a_written_checkpoint_has_openais_tensors_and_config(mxfp4_dir):
    tensors = load_file(mxfp4_dir / "model.safetensors")
    c = get_preset("tiny-gpt-oss-mxfp4").config
    E, W, D = c.moe.num_experts, c.moe.intermediate_size, c.hidden_size
    base = "model.layers.0.mlp.experts."
    shapes = {
        "gate_up_proj_blocks": (torch.uint8, (E, 2 * W, D // 32, 16)),
        "gate_up_proj_scales": (torch.uint8, (E, 2 * W, D // 32)),
        "down_proj_blocks": (torch.uint8, (E, D, W // 32, 16)),
        "down_proj_scales": (torch.uint8, (E, D, W // 32)),
        "gate_up_proj_bias": (torch.bfloat16, (E, 2 * W)),
        "down_proj_bias": (torch.bfloat16, (E, D)),
    }
    for name, (dtype, shape) in shapes.items():
        assert (tensors[base + name].dtype, tuple(tensors[base + name].shape)) == (dtype, shape)
    assert base + "gate_up_proj" not in tensors and base + "down_proj" not in tensors
    q = json.loads((mxfp4_dir / "config.json").read_text())["quantization_config"]
    assert (
        q["quant_method"] == "mxfp4" and "model.layers.*.self_attn" in q["modules_to_not_convert"]
    )


def test_the_experts_are_the_quantizers_blocks_with_gate_and_up_rows_deinterleaved(mxfp4_dir):
    """The blocks loaded for gate / up / down are the quantizer's blocks of the preset's own
    float experts (llama.cpp's MXFP4 rounding), byte for byte."""
    from tandem.models.presets import hot_rows, random_weights
    from tandem.models.quant.quantize import quantize

    src = open_model(mxfp4_dir)
    c = src.config
    floats = random_weights(c, 0, torch.bfloat16, hot_rows(c, None))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}.weight"
        assert src.info(name).dtype == "MXFP4"
        want = quantize(floats[name].float().numpy(), MXFP4)
        assert np.array_equal(src.blocks(name).numpy(), want), proj
        assert src.info(name).nbytes == want.size  # what `tandem plan` counts per expert


def test_a_sharded_checkpoint_gives_the_same_blocks_and_values(mxfp4_dir, tmp_path):
    """Blocks and scales in different shards (an index file) read as one tensor."""
    make_model_dir(tmp_path / "s", "tiny-gpt-oss-mxfp4", shard_bytes=20_000)
    a, b = open_model(mxfp4_dir), open_model(tmp_path / "s")
    assert len({i.file for i in b.md.manifest.values()}) > 2
    assert a.manifest.keys() == b.manifest.keys()
    for name, info in a.manifest.items():
        if info.quantized:
            assert torch.equal(a.blocks(name), b.blocks(name)), name
        assert torch.equal(a.read(name), b.read(name)), name


def test_every_slice_reads_only_its_bytes_and_equals_the_whole_tensors_slice(mxfp4_dir):
    """Experts (dim 0), rows of every expert (dim 1; gate/up rows [a, b) are the file's rows
    [2a, 2b)) and block-aligned columns (dim 2): the blocks equal the whole tensor's slice, and
    the file reads ask for exactly those experts, rows and blocks."""
    src = open_model(mxfp4_dir)
    asked = []
    read = src.md.read_source
    src.md.read_source = lambda name, index: asked.append((name, index)) or read(name, index)
    gate, down = (
        "model.layers.2.mlp.experts.gate_proj.weight",
        "model.layers.2.mlp.experts.down_proj.weight",
    )
    up = gate.replace("gate_proj", "up_proj")
    cases = [
        (gate, 0, 3, 6, (slice(3, 6), slice(0, 128), slice(0, 2))),
        (up, 1, 32, 64, (slice(0, 8), slice(64, 128), slice(0, 2))),
        (down, 2, 32, 64, (slice(0, 8), slice(0, 64), slice(1, 2))),
        (down, 1, 16, 48, (slice(0, 8), slice(16, 48), slice(0, 2))),
    ]
    for name, dim, start, end, index in cases:
        whole = src.blocks(name)
        asked.clear()
        part = src.blocks(name, dim, start, end)
        lo, hi = (start, end) if dim < 2 else (start // 32 * 17, end // 32 * 17)
        assert torch.equal(part, whole.narrow(dim, lo, hi - lo)), (name, dim)
        assert [i[:3] for _, i in asked] == [index, index], (name, dim)
        values = src.read(name, dim, start, end)
        assert torch.equal(values, src.read(name).narrow(dim, start, end - start))
    with pytest.raises(Mxfp4SliceError, match="32-element"):
        src.blocks(down, 2, 16, 48)
    with pytest.raises(Mxfp4SliceError, match="outside"):
        src.blocks(gate, 0, 4, 9)


def test_a_block_tensor_without_its_scales_is_refused_by_name(mxfp4_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((mxfp4_dir / "config.json").read_text())
    tensors = load_file(mxfp4_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(Mxfp4LayoutError, match="layers.1.mlp.experts.down_proj_blocks has no"):
        open_model(d)


def _with_quantization(src_dir, d, arch: str | None, quantization) -> None:
    d.mkdir()
    cfg = json.loads((src_dir / "config.json").read_text())
    if arch is not None:
        cfg["architectures"] = [arch]
    cfg["quantization_config"] = quantization
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes_4bit", "fp8", 3])
def test_another_quant_method_is_refused_naming_it_and_the_one_read(mxfp4_dir, tmp_path, method):
    d = tmp_path / "m"
    _with_quantization(mxfp4_dir, d, None, {"quant_method": method})
    with pytest.raises(UnsupportedQuantizationError, match=f"{method!r}.*'mxfp4'") as e:
        open_model(d)
    assert str(d / "config.json") in str(e.value)


def test_mxfp4_on_another_architecture_and_a_malformed_section_are_refused(mxfp4_dir, tmp_path):
    _with_quantization(mxfp4_dir, tmp_path / "a", "LlamaForCausalLM", {"quant_method": "mxfp4"})
    with pytest.raises(UnsupportedQuantizationError, match="none for LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path / "a")
    _with_quantization(mxfp4_dir, tmp_path / "b", None, ["mxfp4"])
    with pytest.raises(ConfigError, match="quantization_config"):
        ModelConfig.from_dir(tmp_path / "b")


def test_quantizing_an_mxfp4_checkpoint_again_is_refused(mxfp4_dir, tmp_path):
    """`--quantize` and `tandem quantize` would dequantize the blocks and quantize them again."""
    from tandem.loaders.gguf.writer import write_model_dir_gguf

    with pytest.raises(QuantizeChoiceError, match="MXFP4"):
        open_model(mxfp4_dir, "q8_0")
    with pytest.raises(QuantizeChoiceError, match="already MXFP4"):
        write_model_dir_gguf(mxfp4_dir, tmp_path / "m.gguf", "Q8_0")
    assert not (tmp_path / "m.gguf").exists()
    assert isinstance(open_model(mxfp4_dir), Mxfp4ModelDir)


def test_tandem_plan_shows_an_mxfp4_checkpoints_expert_placement(mxfp4_dir):
    """`tandem plan --model`'s placement: its expert bytes at MXFP4's 17 bytes per 32 weights,
    over the ranks the file's expert bytes (`info().nbytes`, the blocks' own)."""
    from tandem.parallel.moe_reads import source_bytes
    from tandem.plan.experts import place_experts, render_placement
    from tandem.plan.model import Layout, NodeSpec

    src = open_model(mxfp4_dir)
    cfg = src.config
    nodes = [NodeSpec("a", 0.01), NodeSpec("b", 0.01)]
    every = [f"model.layers.{i}.mlp.experts.{p}_proj.weight"
             for i in range(cfg.num_hidden_layers) for p in ("gate", "up", "down")]  # fmt: skip
    for moe, line in (
        ("tp", "rank 1 (b): experts [0, 8) rows [32, 64) (8 experts, 50 %"),
        ("experts", "rank 1 (b): experts [4, 8) rows [0, 64) (4 experts, 100 %"),
    ):
        placed = place_experts(
            cfg, Layout(2), (cfg.num_hidden_layers,), nodes, moe, source_bytes(src)
        )
        assert line in render_placement(cfg, placed, "as stored")
        held = sum(r.reads.held_expert_bytes for r in placed.ranks)
        assert held == pytest.approx(sum(src.info(n).nbytes for n in every), rel=1e-12)
