"""`tandem quantize`'s file and `--quantize`'s in-memory model are the same model: a safetensors
directory written by `writer.write_model_dir_gguf` loads through the GGUF loader with the blocks
the in-memory `QuantizedModelDir` builds, byte for byte, and the same logits; Q8_0 / Q4_0 blocks
are gguf-py's quantize of the original weights; the tokenizer travels in the file."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.quantized_dir import QuantizeChoiceError, QuantizedModelDir
from tandem.loaders.gguf.writer import write_model_dir_gguf
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import ModelDir
from tandem.loaders.source import open_model
from tandem.loaders.tokenizer_build import build_byte_bpe, tokenizer_config
from tandem.loaders.writer import write_model_dir
from tandem.models.presets import get_preset, hot_rows, random_weights
from tandem.models.quant.blocks import BY_ID
from tandem.models.quant.linear import QuantEmbedding, QuantLinear

# K-quants need rows of whole 256-element superblocks
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
IDS = torch.tensor([[5, 17, 42, 99, 3, 7, 250, 11]])
TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A llama (q/k rows permuted in the file) with a byte-level BPE tokenizer, bf16 on disk."""
    config = replace(get_preset("tiny-llama").config, head_dim=64, **SHAPE, torch_dtype="bfloat16")
    tok = build_byte_bpe(config.vocab_size)
    tensors = random_weights(config, 3, torch.bfloat16, hot_rows(config, None))
    out = tmp_path_factory.mktemp("hf") / "m"
    write_model_dir(
        out, config, tensors, tokenizer_json=tok.to_str(), tokenizer_config=tokenizer_config()
    )
    return out


@pytest.fixture(scope="module", params=sorted(TYPES))
def pair(request, hf_dir, tmp_path_factory):
    """(choice, the file's model, the in-memory model, the file's source)."""
    choice = request.param
    (f,) = write_model_dir_gguf(hf_dir, tmp_path_factory.mktemp("q") / "m.gguf", TYPES[choice])
    src = GGUFModel(f)
    return choice, load_model(src), load_model(open_model(hf_dir, choice)), src


def quant_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


def test_the_file_and_the_in_memory_model_hold_the_same_blocks_and_give_the_same_logits(pair):
    choice, from_file, in_memory, _ = pair
    a, b = quant_modules(from_file), quant_modules(in_memory)
    layers = from_file.config.num_hidden_layers
    assert a.keys() == b.keys() and len(a) == 2 + 7 * layers  # embedding, tied head, 7 a layer
    for name in a:
        assert a[name].qtype == b[name].qtype
        assert torch.equal(a[name].qweight, b[name].qweight), name
    assert {BY_ID[m.qtype].name for m in a.values()} == {TYPES[choice]}
    with torch.no_grad():
        assert torch.equal(from_file(IDS), in_memory(IDS))


def test_q8_0_and_q4_0_files_hold_gguf_py_quantize_of_the_original_weights(pair, hf_dir):
    choice, _, _, src = pair
    if choice == "q4_k":
        pytest.skip("gguf-py does not quantize Q4_K")
    md = ModelDir(hf_dir)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        want = quants.quantize(md.read(name).float().numpy(), GGMLQuantizationType[TYPES[choice]])
        # the loader un-permutes the llama q rows: these are the HF-order rows
        assert np.array_equal(
            src.blocks(name).numpy(), want.view(np.uint8).reshape(want.shape[0], -1)
        )


def test_the_file_carries_the_directorys_tokenizer(pair, hf_dir):
    *_, src = pair
    text = "hello world, quantized"
    assert src.tokenizer().encode(text) == ModelDir(hf_dir).tokenizer().encode(text)


def test_quantize_refuses_a_gguf_file_and_an_unknown_type(pair, hf_dir):
    *_, src = pair
    with pytest.raises(QuantizeChoiceError, match="GGUF file keeps its own types"):
        open_model(src.path, "q4_k")
    with pytest.raises(QuantizeChoiceError, match="q8_0, q4_0, q4_k"):
        QuantizedModelDir(ModelDir(hf_dir), "q3_k")


def test_serve_quantizes_at_load_and_answers_with_the_files_greedy_text(hf_dir, tmp_path):
    """`tandem serve --model DIR --quantize q4_k`'s engine (built as the command builds it)."""
    import threading

    from tandem.cli.engine_factory import build_serving_engine
    from tandem.engine.generate import generate
    from tandem.engine.local import LocalExecutor
    from tandem.engine.sampling_params import SamplingParams

    (f,) = write_model_dir_gguf(hf_dir, tmp_path / "m.gguf", "Q4_K")
    ex = LocalExecutor(load_model(GGUFModel(f)), max_batch=1, max_seq_len=64)
    (want,) = generate(ex, [[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0))
    engine, close = build_serving_engine(hf_dir, quantize="q4_k", max_seq_len=64, max_batch=1)
    done, result = threading.Event(), {}
    try:
        engine.generate(
            [5, 6, 7],
            SamplingParams(max_tokens=6, temperature=0.0),
            (),
            lambda d: None,
            lambda c, e: (result.update(c=c, e=e), done.set()),
        )
        assert done.wait(60), "generation hung"
    finally:
        close()
    c = result["c"]
    assert result["e"] is None and c.completion_tokens >= 1
    assert c.text == engine.tokenizer.decode(want.token_ids[: c.completion_tokens])
