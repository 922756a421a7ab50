"""GGUF files as model sources: config from metadata, weights kept in their blocks (mapped, no
dequantized copy), the llama q/k permutation undone, split files and folders, the fingerprint,
and the typed refusal of tensor parallelism."""

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from tandem.config import ModelConfig, RopeScaling
from tandem.loaders.gguf.model_file import GGUFModel, gguf_files
from tandem.loaders.gguf.names import (
    GLOBAL_NAMES,
    LAYER_NAMES,
    gguf_name,
    hf_name,
    permute_rows,
    unpermute_rows,
)
from tandem.loaders.gguf.reader import GGUFMissingFileError
from tandem.loaders.gguf.writer import write_gguf, write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.families import gpt_oss
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset, random_weights
from tandem.models.quant.blocks import BY_NAME
from tandem.models.quant.dequant import dequantize
from tandem.models.quant.linear import QuantEmbedding, QuantLinear
from tandem.models.quant.quantize import quantize
from tandem.models.rope import rope_inv_freq

IDS = torch.tensor([[5, 17, 42, 99, 3, 7, 250, 11]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)[0]


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    cfg, (f,) = write_preset_gguf(d / "tiny.gguf", "tiny-llama", "Q8_0", seed=3)
    return cfg, f


def test_metadata_gives_the_config_the_model_was_written_from(tmp_path):
    for preset, kind in (
        ("tiny-llama-untied", "Q4_0"),
        ("tiny-qwen2", "Q5_1"),
        ("tiny-qwen3", "Q8_0"),
    ):
        cfg, (f,) = write_preset_gguf(tmp_path / f"{preset}.gguf", preset, kind)
        got = GGUFModel(f).config
        # GGUF stores eps as float32, one eos id (the tokenizer's, <|im_end|>) and not the dtype
        # the weights came in
        eps = float(np.float32(cfg.rms_norm_eps))
        want = replace(cfg, rms_norm_eps=eps, eos_token_ids=(2,), torch_dtype="float32")
        assert got == want, preset


def test_every_model_parameter_has_one_gguf_name_and_back():
    cfg = get_preset("tiny-qwen2").config
    with torch.device("meta"):
        model = Transformer(replace(cfg, qk_norm=True, tie_word_embeddings=False))
        moe = get_preset("tiny-qwen3-moe").config
        shared = replace(
            moe.moe, shared_intermediate_size=32
        )  # every MoE tensor, shared expert too
        sparse = Transformer(replace(moe, moe=shared))
    names = [n for n, _ in model.named_parameters()]
    names += [n for n, _ in sparse.named_parameters() if n.startswith("model.layers.0.mlp.")]
    assert len({gguf_name(n) for n in names}) == len(names)
    assert all(hf_name(gguf_name(n)) == n for n in names)
    assert len(GLOBAL_NAMES) + len(LAYER_NAMES) == 23
    # gpt-oss: a bare parameter (no `.weight` in HF) and its own name for the second norm
    assert gguf_name("model.layers.3.self_attn.sinks") == "blk.3.attn_sinks.weight"
    assert hf_name("blk.3.attn_sinks.weight") == "model.layers.3.self_attn.sinks"
    oss = gpt_oss.FAMILY.gguf_names
    assert hf_name("blk.3.post_attention_norm.weight") is None
    assert (
        hf_name("blk.3.post_attention_norm.weight", oss)
        == "model.layers.3.post_attention_layernorm.weight"
    )
    ln = "model.layers.3.post_attention_layernorm.weight"
    assert (gguf_name(ln), gguf_name(ln, oss)) == (
        "blk.3.ffn_norm.weight",
        "blk.3.post_attention_norm.weight",
    )
    assert hf_name("blk.0.attn_qkv.weight") is None


def test_llama_q_k_permutation_is_undone_exactly_and_keeps_whole_block_rows(tmp_path):
    rows = torch.arange(4 * 16 * 3).reshape(64, 3)
    assert torch.equal(unpermute_rows(permute_rows(rows, 4), 4), rows)
    assert not torch.equal(permute_rows(rows, 4), rows)
    cfg = get_preset("tiny-llama").config
    weights = random_weights(cfg, 3, torch.float32)
    (f,) = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype="Q8_0")
    src = GGUFModel(f)
    q8 = BY_NAME["Q8_0"].type_id
    # the writer quantized llama.cpp's row order; each Q8_0 row is its own blocks, so the
    # un-permuted blocks are the HF rows' blocks exactly
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ):
        stored = src._view(src.info(name))
        want = torch.from_numpy(quantize(weights[name].numpy(), q8))
        assert not torch.equal(stored, want)
        assert torch.equal(src.blocks(name), want), name
        assert torch.equal(src.read(name), dequantize(want, q8))
    v = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(src.blocks(v), torch.from_numpy(quantize(weights[v].numpy(), q8)))


def test_quantized_weights_stay_mapped_in_their_blocks_and_the_tied_head_shares_them(llama_q8):
    _, f = llama_q8
    src = GGUFModel(f)
    model = load_model(src)
    attn = model.model.layers["0"].self_attn
    assert isinstance(attn.v_proj, QuantLinear) and isinstance(attn.q_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    mapping = src.readers[0].data
    lo = mapping.ctypes.data
    inside = lambda t: lo <= t.data_ptr() < lo + len(mapping)  # noqa: E731
    assert inside(attn.v_proj.qweight) and inside(model.model.embed_tokens.qweight)
    assert not inside(attn.q_proj.qweight)  # the un-permuted copy (model_file docstring)
    assert model.lm_head.qweight.data_ptr() == model.model.embed_tokens.qweight.data_ptr()
    dense = sum(p.numel() for p in model.parameters())
    assert dense == 2 * (64 + 64) + 64  # only the norms are dense parameters
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_split_parts_and_a_folder_load_the_same_model_as_one_file(tmp_path, llama_q8):
    _, one = llama_q8
    _, parts = write_preset_gguf(tmp_path / "s" / "tiny.gguf", "tiny-llama", "Q8_0", seed=3,
                                 split_max_tensors=7)  # fmt: skip
    assert len(parts) == 3 and parts[0].name == "tiny-00001-of-00003.gguf"
    assert gguf_files(parts[2]) == parts
    want = logits(load_model(GGUFModel(one)))
    for path in (parts[0], parts[1], tmp_path / "s"):
        assert torch.equal(logits(load_model(open_model(path))), want), path
    folder = tmp_path / "f"
    folder.mkdir()
    shutil.copy(one, folder / "model.gguf")
    assert torch.equal(logits(load_model(open_model(folder))), want)
    shutil.copy(one, folder / "other.gguf")
    with pytest.raises(
        GGUFMissingFileError, match="exactly one GGUF model .*model.gguf, other.gguf"
    ):
        open_model(folder)
    parts[1].unlink()
    with pytest.raises(GGUFMissingFileError, match="tiny-00002-of-00003.gguf not found"):
        open_model(parts[0])


def test_fingerprint_tells_files_apart_and_is_stable(tmp_path, llama_q8):
    _, f = llama_q8
    fp = GGUFModel(f).fingerprint()
    assert GGUFModel(f).fingerprint() == fp
    _, (q4,) = write_preset_gguf(tmp_path / "q4.gguf", "tiny-llama", "Q4_0", seed=3)
    _, (other,) = write_preset_gguf(tmp_path / "s4.gguf", "tiny-llama", "Q8_0", seed=4)
    assert len({fp, GGUFModel(q4).fingerprint(), GGUFModel(other).fingerprint()}) == 3


def test_linear_rope_scaling_and_llama3_frequency_factors_reach_the_rope(tmp_path):
    base = get_preset("tiny-llama").config
    lin = replace(base, rope_scaling=RopeScaling("linear", 4.0))
    _, (f,) = write_preset_gguf(tmp_path / "lin.gguf", "tiny-llama", "Q8_0", config=lin)
    got = GGUFModel(f).config
    assert got.rope_scaling == RopeScaling("linear", 4.0)
    assert torch.equal(rope_inv_freq(got), rope_inv_freq(base) / 4.0)
    assert ModelConfig.from_hf_dict(lin.to_hf_dict()).rope_scaling == lin.rope_scaling
    l3 = get_preset("tiny-llama3-rope-scaling").config
    _, (f3,) = write_preset_gguf(tmp_path / "l3.gguf", "tiny-llama3-rope-scaling", "Q8_0")
    got3 = GGUFModel(f3).config
    assert got3.rope_scaling is None and len(got3.rope_freq_factors) == l3.head_dim // 2
    # llama.cpp's divisors reproduce HF's llama3 formula to float32 rounding
    torch.testing.assert_close(rope_inv_freq(got3), rope_inv_freq(l3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", ["F32", "BF16"])
def test_an_hf_directory_written_as_a_dense_gguf_loads_to_the_directory_logits(tmp_path, qtype):
    """The presets' weights are bfloat16 values, so F32 and BF16 files hold them exactly: the
    GGUF model (dense parameters, q/k permuted and back) is the directory's model bit for bit."""
    from tandem.loaders.gguf.writer import write_model_dir_gguf
    from tandem.loaders.make import make_model_dir

    make_model_dir(tmp_path / "hf", "tiny-llama-untied", seed=2)
    (f,) = write_model_dir_gguf(tmp_path / "hf", tmp_path / "m.gguf", qtype)
    src = GGUFModel(f)
    assert {i.dtype for i in src.manifest.values()} == {"F32", qtype}
    model = load_model(src)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert torch.equal(logits(model), logits(load_model(open_model(tmp_path / "hf"))))


def test_k_quants_fall_back_like_llama_cpp_where_rows_are_not_whole_superblocks():
    from tandem.loaders.gguf.writer import K_MIX, tensor_type

    assert tensor_type("blk.0.attn_q.weight", (576, 576), K_MIX, True) == "Q5_0"
    assert tensor_type("blk.0.attn_v.weight", (192, 576), K_MIX, True) == "Q8_0"
    assert tensor_type("blk.0.ffn_down.weight", (576, 992), K_MIX, True) == "Q5_1"
    assert tensor_type("blk.0.ffn_down.weight", (576, 1024), K_MIX, True) == "Q5_K"
    assert tensor_type("token_embd.weight", (512, 256), K_MIX, True) == "Q6_K"
    assert tensor_type("token_embd.weight", (512, 256), K_MIX, False) == "Q4_K"
    assert tensor_type("blk.0.attn_norm.weight", (256,), "Q4_K", True) == "F32"
    assert tensor_type("output.weight", (512, 48), "Q8_0", False) == "F16"


def test_an_mxfp4_moe_file_keeps_every_matrix_and_expert_in_its_blocks(tmp_path):
    """MXFP4 (ggml type 39, gpt-oss's expert type) written, read and loaded like any block type:
    the stored blocks are `quantize`'s, read() their dequantization, the modules hold them."""
    from tandem.models.quant.linear import QuantExpertLinear

    cfg = get_preset("tiny-qwen3-moe").config
    weights = random_weights(cfg, 3, torch.float32)
    (f,) = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype="MXFP4")
    src = GGUFModel(f)
    mx = BY_NAME["MXFP4"].type_id
    for name in ("model.layers.0.mlp.experts.down_proj.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.1.self_attn.v_proj.weight"):  # fmt: skip
        want = torch.from_numpy(quantize(weights[name].numpy(), mx))
        if name.endswith("mlp.gate.weight"):  # the router stays F32, as llama-quantize keeps it
            assert src.info(name).type_id == BY_NAME["F32"].type_id
            continue
        assert src.info(name).type_id == mx
        assert torch.equal(src.blocks(name), want), name
        assert torch.equal(src.read(name), dequantize(want, mx))
    model = load_model(src)
    experts = model.model.layers["0"].mlp.experts
    assert isinstance(experts.down_proj, QuantExpertLinear) and experts.down_proj.qtype == mx
    assert torch.isfinite(logits(model)).all()


def test_the_written_tokenizer_reads_back_as_the_preset_tokenizer(llama_q8):
    from tandem.loaders.tokenizer_build import build_byte_bpe

    _, f = llama_q8
    tok, want = GGUFModel(f).tokenizer(), build_byte_bpe(512)
    for text in ("Hello, world! How are you today?", "def f(x):\n    return  x+1", "ünïcödé 3.14"):
        assert tok.encode(text) == want.encode(text, add_special_tokens=False).ids, text
    assert tok.eos_token_ids[0] == want.token_to_id("<|im_end|>")
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert GGUFModel(f).weight_format() == "GGUF Q8_0/F32"
