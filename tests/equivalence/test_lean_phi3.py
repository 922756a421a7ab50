"""The torch-free path (`LeanExecutor`) on a Phi-3 GGUF equals transformers in float32: tiny-phi3
as llama.cpp's converter lays out a `phi3` file (fused attn_qkv and ffn_up), its layer weights in
BF16, written by tandem's writer.

- A plain file (full rotary, no rope scaling, no window): against transformers reading the same
  file (`from_pretrained(dir, gguf_file=...)`, gguf-py's dequantization).
- Phi-3.5 / Phi-4-mini's blocks: partial rotary (48 of 64 dims), longrope with a switch at 32
  tokens (original_max_position_embeddings), a window of 24 on every layer. transformers' GGUF
  reader ignores rope.dimension_count, the rope_factors_* tensors and the window, so the reference
  is its Phi3ForCausalLM configured as the file states over the same tensors
  (`gguf_twin_support.phi3_twin`). The logits follow a prefill of 20 then 16 decode tokens,
  crossing the switch at the 33rd token; transformers recomputes every position from the long set
  there (its forward over the whole prefix), and the executor recomputes the sequence
  (`engine.rope_rewind`). Greedy: prompts of 8 and 3 in one batch, 32 new tokens, so both cross
  the switch in decode, against transformers' own generate (which drops its cache at the
  crossing).

The bound. BF16 weights are multiplied with float32 activations (no int8 rounding), so the two
differ in float32 summation order only: logits within LOGIT_ATOL = 1e-4; greedy ids up to the
first step whose top-2 gap is below NEAR_TIE = 1e-3. Quantized files round activations to int8
in every product (tests/equivalence/test_lean_gpt_oss.py says why the torch path on the same
kernels is their witness: tests/unit/test_lean_executor.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from gguf_twin_support import assert_logits_follow, phi3_twin
from test_gguf_equivalence import hf_generate_greedy

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
SHAPE = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64,
)  # fmt: skip
CROSSING_STEPS = tuple(range(40, 56))  # decode tokens 21..36: the switch at 32 crossed


def _file(tmp_path_factory, name: str, **kw):
    cfg = dataclasses.replace(get_preset("tiny-phi3").config, **SHAPE, **kw)
    out = tmp_path_factory.mktemp("lean-phi3") / f"{name}-BF16.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-phi3", "BF16", config=cfg)
    return f


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory):
    return _file(
        tmp_path_factory, "phi3", partial_rotary_factor=1.0, rope_scaling=None, sliding_window=None
    )


@pytest.fixture(scope="module")
def longrope_file(tmp_path_factory):
    base = get_preset("tiny-phi3").config.rope_scaling
    scaling = dataclasses.replace(
        base,
        short_factor=tuple(1.0 + i / 20 for i in range(24)),  # rotary_dim / 2 = 24
        long_factor=tuple(1.0 + i / 2 for i in range(24)),
    )
    return _file(tmp_path_factory, "phi4", rope_scaling=scaling, sliding_window=24)


def _lean(f, batch: int) -> LeanExecutor:
    return LeanExecutor.from_file(f, max_batch=batch, max_seq_len=64, threads=2)


def _assert_greedy(lean: LeanExecutor, hf) -> None:
    results = generate(lean, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    compared = 0
    for prompt, r in zip(PROMPTS, results):
        want, gaps = hf_generate_greedy(hf, prompt, NEW_TOKENS)
        k = next((i + 1 for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
        assert r.token_ids[:k] == want[:k], (prompt, r.token_ids, want, gaps)
        compared += k
    assert compared >= NEW_TOKENS


def test_lean_phi3_logits_and_greedy_ids_equal_transformers_reading_the_file(plain_file) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(plain_file.parent), gguf_file=plain_file.name, dtype=torch.float32, pad_token_id=0
    ).eval()  # Phi3Config's default pad id (32000) is past this vocabulary
    lean = _lean(plain_file, 2)
    assert lean.model.decode_token is not None  # one native call a decode token
    assert_logits_follow(lean, hf, LOGIT_ATOL)
    lean.release([0])
    _assert_greedy(lean, hf)


def test_lean_phi3_partial_rotary_longrope_and_window_logits_follow_transformers(
    longrope_file,
) -> None:
    hf = phi3_twin(longrope_file)
    lean = _lean(longrope_file, 1)
    c = lean.model.config
    assert (c.rotary_dim, c.head_dim, c.sliding_window) == (48, 64, 24)
    assert c.rope_scaling.rope_type == "longrope"
    assert c.rope_scaling.original_max_position_embeddings == 32
    assert_logits_follow(lean, hf, LOGIT_ATOL, steps=CROSSING_STEPS)


def test_lean_phi3_partial_rotary_longrope_and_window_greedy_ids_equal_transformers(
    longrope_file,
) -> None:
    _assert_greedy(_lean(longrope_file, 2), phi3_twin(longrope_file))
