"""The torch-free path (`LeanExecutor`) on a gpt-oss GGUF equals transformers' GptOssForCausalLM in
float32 over the same file's tensors as gguf-py dequantizes them (`gguf_twin_support.gpt_oss_twin`):
tiny-gpt-oss (attention biases and sinks, a window of 8 on layers 0 and 2, YaRN, the biased router,
biased clamped-SwiGLU experts) with its layer weights in BF16, written by tandem's writer.

The bound. BF16 weights are multiplied with float32 activations (no int8 rounding), so the two
differ only in float32 summation order: ~1.5e-5 on these logits as measured; LOGIT_ATOL = 1e-4.
Greedy ids over 32 new tokens (prompts of 8 and 3 in one batch, so both cross the window) are
compared up to the first step whose top-2 gap is below NEAR_TIE = 1e-3.

The quantized files (Q8_0, K-quants, MXFP4 experts, llama.cpp's own) round activations to int8 in
every product, as llama.cpp's kernels do; that moves these tiny models' logits by up to ~2 over 32
steps against the float32 reference, so there the witness is the torch path on the same kernels
(tests/unit/test_lean_executor.py), which tests/equivalence/test_gguf_equivalence.py holds to
transformers.
"""

from __future__ import annotations

import dataclasses

import pytest
from gguf_twin_support import assert_logits_follow, gpt_oss_twin
from test_gguf_equivalence import hf_greedy

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


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    base = get_preset("tiny-gpt-oss").config
    cfg = dataclasses.replace(
        base, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=256, moe=dataclasses.replace(base.moe, intermediate_size=256),
    )  # fmt: skip
    out = tmp_path_factory.mktemp("lean-oss-hf") / "gpt-oss-BF16.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-gpt-oss", "BF16", config=cfg)
    return f


def test_lean_gpt_oss_logits_equal_transformers(bf16_file) -> None:
    """Every position's logits of a 20-token prompt (prefill, windows crossed), then decode
    tokens one by one, each within LOGIT_ATOL of transformers' over the same prefix."""
    hf = gpt_oss_twin(bf16_file)
    lean = LeanExecutor.from_file(bf16_file, max_batch=1, max_seq_len=64, threads=2)
    assert_logits_follow(lean, hf, LOGIT_ATOL)


def test_lean_gpt_oss_greedy_ids_equal_transformers(bf16_file) -> None:
    """Both prompts in one batch through the head's loop on LeanExecutor, against transformers
    one prompt at a time."""
    hf = gpt_oss_twin(bf16_file)
    lean = LeanExecutor.from_file(bf16_file, max_batch=2, max_seq_len=64, threads=2)
    results = generate(lean, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    compared = 0
    for prompt, r in zip(PROMPTS, results):
        want, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
        k = next((i + 1 for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
        assert r.token_ids[:k] == want[:k], (prompt, r.token_ids, want, gaps)
        compared += k
    assert compared >= NEW_TOKENS
