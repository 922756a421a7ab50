"""Preset weights make 16-bit greedy decoding follow the float32 reference (clear logit margins)."""

import pytest
import torch

from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir

PROMPTS = [[5, 6, 7, 8], [300, 17], [44, 45, 46, 47, 48, 49]]


def greedy(md, dtype, n):
    ex = LocalExecutor(load_model(md, dtype=dtype), max_batch=3, max_seq_len=64)
    return [
        r.token_ids for r in generate(ex, PROMPTS, SamplingParams(max_tokens=n, temperature=0.0))
    ]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama-untied"])
def test_float16_greedy_ids_follow_float32_for_32_tokens(tmp_path, preset):
    make_model_dir(tmp_path / preset, preset, seed=0)
    md = ModelDir(tmp_path / preset)
    ref = greedy(md, torch.float32, 32)
    assert greedy(md, torch.float16, 32) == ref
    assert [s[:8] for s in greedy(md, torch.bfloat16, 8)] == [s[:8] for s in ref]
    assert len({t for s in ref for t in s}) > 6  # not a model that repeats one token
