"""The torch-free path (`LeanExecutor`) on a Gemma 3 GGUF equals transformers reading the same file
(`from_pretrained(dir, gguf_file=...)`, gguf-py's dequantization, float32): tiny-gemma3 in BF16
as a gemma3 file states it (query_pre_attn_scalar and the local rope base at llama.cpp's values,
no rope scaling, which transformers does not read from a GGUF), 7 layers (windowed 0-4 and 6),
MQA, a window of 8 that the prompts and their 32 new tokens cross.

The bound. BF16 weights are multiplied with float32 activations, so the two differ in float32
summation order (and numpy's tanh for torch's in GELU): logits within LOGIT_ATOL = 1e-4; greedy
ids over 32 tokens, both prompts in one batch, up to the first step whose top-2 gap is below
NEAR_TIE = 1e-3.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from gguf_twin_support import assert_logits_follow

from tandem.engine.generate import generate
from tandem.engine.lean import LeanExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels import native
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

LOGIT_ATOL = 1e-4
NEAR_TIE = 1e-3
NEW_TOKENS = 32
PROMPTS = [[5, 17, 42, 99, 3, 7, 250, 11], [300, 1, 2]]
GEMMA3 = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, query_pre_attn_scalar=None, rope_scaling=None, embed_scale=256**0.5,
)  # fmt: skip


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory):
    cfg = dataclasses.replace(get_preset("tiny-gemma3").config, **GEMMA3)
    out = tmp_path_factory.mktemp("lean-gemma-hf") / "gemma3-BF16.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-gemma3", "BF16", config=cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(f.parent), gguf_file=f.name, dtype=torch.float32
    ).eval()
    return f, hf


def test_lean_gemma3_logits_equal_transformers(gemma_file) -> None:
    """A 20-token prefill (windows crossed), then 5 decode tokens, each within LOGIT_ATOL."""
    f, hf = gemma_file
    lean = LeanExecutor.from_file(f, max_batch=1, max_seq_len=64, threads=2)
    assert_logits_follow(lean, hf, LOGIT_ATOL)


def test_lean_gemma3_greedy_ids_equal_transformers(gemma_file) -> None:
    f, hf = gemma_file
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    results = generate(lean, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    compared = 0
    for prompt, r in zip(PROMPTS, results):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
        want = out.sequences[0, len(prompt) :].tolist()
        gaps = [float(lg[0].topk(2).values.diff().abs()) for lg in out.logits]
        k = next((i + 1 for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
        assert r.token_ids[:k] == want[:k], (prompt, r.token_ids, want, gaps)
        compared += k
    assert compared >= NEW_TOKENS
