"""`GGUFModel.blocks(name, dim, start, end)`: a rank's slice of a quantized tensor equals that slice
of the whole tensor's blocks, byte for byte (llama q/k rows un-permuted within their own heads),
and a slice off the block or head boundaries is a typed error."""

import pytest
import torch

from tandem.loaders.gguf.model_file import GGUFModel, GGUFSliceError
from tandem.loaders.gguf.writer import write_preset_gguf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    _, (f,) = write_preset_gguf(tmp_path_factory.mktemp("s") / "l.gguf", "tiny-llama", "Q8_0")
    return GGUFModel(f)


def test_row_and_column_slices_equal_the_whole_tensors_blocks(llama):
    c = llama.config
    hd = c.head_dim or c.hidden_size // c.num_attention_heads
    q = "model.layers.0.self_attn.q_proj.weight"
    whole = llama.blocks(q)
    got = llama.blocks(q, 0, hd, 3 * hd)  # heads 1 and 2 of the permuted q rows
    assert torch.equal(got, whole[hd : 3 * hd])
    k = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(llama.blocks(k, 0, 0, hd), llama.blocks(k)[:hd])
    down = "model.layers.0.mlp.down_proj.weight"
    cols = llama.info(down).shape[1]
    full = llama.blocks(down)
    half = cols // 2 // 32 * 32
    bb = 34  # Q8_0: 32 values in 34 bytes
    assert torch.equal(llama.blocks(down, 1, half, cols), full[:, half // 32 * bb :])
    assert torch.equal(llama.read(down, 1, 0, half), llama.read(down)[:, :half])


def test_slices_off_blocks_heads_or_range_are_typed_errors(llama):
    down = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(GGUFSliceError, match="block boundaries"):
        llama.blocks(down, 1, 16, 64)
    with pytest.raises(GGUFSliceError, match="whole heads"):
        llama.blocks("model.layers.0.self_attn.q_proj.weight", 0, 1, 9)
    with pytest.raises(GGUFSliceError, match="outside"):
        llama.blocks(down, 0, 0, 10**6)
