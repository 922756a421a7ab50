"""Batch invariance (issue 30): a sequence's logits are bit for bit the same whatever else the
step holds. For random step compositions (1-16 sequences, prompts prefilled in one step or in
chunks over several steps beside other sequences' chunks and decode tokens, sequences joining
late, sitting steps out and leaving, slots reused, rows in any order), each sequence's logits
after every step equal (np.array_equal) those of the same tokens run alone: the prompt prefilled
in one step, then one decode token per step; a chunk that ends inside the prompt equals the
one-step prefill of the prompt up to there.

Why it holds: every per-row operation computes a row from that row alone, in one fixed order,
whatever the number of rows in the call: the linear layers (csrc/gemv.c's row kernel at every
row count on the torch path; csrc/qgemv.c's dense rows on the torch-free one), the norms, RoPE,
SwiGLU and residual adds (elementwise or per row), and attention (csrc/decode_ops.c's
attend_group for every query row over exactly its visible keys: decode, prefill, a whole step;
windows and sinks included). The padding of a batch's rows is computed and never read.

On a BF16 GGUF: `LeanExecutor` (torch-free) and `LocalExecutor` on the native kernels in float32
and in bfloat16; BF16 gpt-oss and Gemma 3 GGUFs (gpt-oss: a window of 8 on alternate layers,
attention sinks, MoE experts, each expert's tokens one product of dense rows) on `LeanExecutor`; and in memory a
gpt-oss-shaped model and a model windowed on every layer (Mistral's), on `LocalExecutor`. The
quantized types (Q8_0, a K-quant mix) hold through csrc/canon.h's one summation order for
qgemv.c and qgemm*.c alike; they run fewer examples, unshrunk, to keep the suite's time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from invariance_support import (
    QTYPES,
    SHAPE,
    VOCAB,
    as_numpy,
    property_run,
    write_tiny_gguf,
)
from tp_support import random_reference, tiny_config

from tandem.engine.executor import Step, StepSequence
from tandem.engine.lean import LeanExecutor
from tandem.engine.local import LocalExecutor
from tandem.kernels import native
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

MAX_BATCH, MAX_LEN = 16, 40
KINDS = ["lean", "local-f32", "local-bf16"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    files = {}

    def get(qtype: str):
        if qtype not in files:
            out = tmp_path_factory.mktemp("invariance") / f"tiny-qwen3-{qtype}.gguf"
            files[qtype] = write_tiny_gguf(out, qtype)
        return files[qtype]

    return get


def executor(kind: str, f):
    if kind == "lean":
        return LeanExecutor.from_file(f, max_batch=MAX_BATCH, max_seq_len=MAX_LEN, threads=2)
    dtype = {"local-f32": torch.float32, "local-bf16": torch.bfloat16}[kind]
    return LocalExecutor.from_dir(f, max_batch=MAX_BATCH, max_seq_len=MAX_LEN, dtype=dtype)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_each_sequences_logits_are_the_same_bits_alone_or_in_any_step(gguf_file, kind, qtype):
    f = gguf_file(qtype)
    # the quantized types: fewer examples, no shrinking (time)
    quantized = qtype != "BF16"
    property_run(executor(kind, f), executor(kind, f), 4 if quantized else 20, shrink=not quantized)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_continuing_a_cached_prefix_equals_the_one_step_prefill(gguf_file, kind, qtype):
    """The prompt's first k tokens prefilled in an earlier step (beside another sequence), the
    rest continuing from start_pos k: the logits equal the whole prompt's in one step, and the
    next decode token's too, for every k."""
    ex = executor(kind, gguf_file(qtype))
    prompt = tuple(int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 13))
    whole = as_numpy(ex.run(Step((StepSequence(0, prompt, 0),))).logits)[0]
    after = as_numpy(ex.run(Step((StepSequence(0, (5,), len(prompt)),))).logits)[0]
    ex.release([0])
    for k in range(1, len(prompt)):
        ex.run(Step((StepSequence(1, (9, 8, 7), 0), StepSequence(0, prompt[:k], 0))))
        got = as_numpy(ex.run(Step((StepSequence(0, prompt[k:], k),))).logits)[0]
        nxt = as_numpy(ex.run(Step((StepSequence(0, (5,), len(prompt)),))).logits)[0]
        ex.release([0, 1])
        assert np.array_equal(got, whole), k
        assert np.array_equal(nxt, after), k


def _in_memory(config) -> LocalExecutor:
    return LocalExecutor(random_reference(config, seed=3), MAX_BATCH, MAX_LEN)


def gpt_oss_config():
    """tiny-gpt-oss (a window of 8 on layers 0 and 2, attention sinks, biased router, clamped
    experts, YaRN) at a vocabulary the prompts draw from."""
    return dataclasses.replace(get_preset("tiny-gpt-oss").config, vocab_size=VOCAB)


def windowed_config():
    """A window of 6 on every layer (Mistral's form: the window folded into the step's mask)."""
    return tiny_config("LlamaForCausalLM", vocab_size=VOCAB, sliding_window=6)


def test_gpt_oss_on_the_torch_free_path_is_batch_invariant_too(tmp_path):
    base = get_preset("tiny-gpt-oss").config
    moe = dataclasses.replace(base.moe, intermediate_size=SHAPE["intermediate_size"])
    cfg = dataclasses.replace(base, **SHAPE, vocab_size=VOCAB, moe=moe)
    _, (f,) = write_preset_gguf(tmp_path / "gpt-oss-BF16.gguf", "tiny-gpt-oss", "BF16", config=cfg)
    property_run(executor("lean", f), executor("lean", f), 12)


def test_gemma3_on_the_torch_free_path_is_batch_invariant_too(tmp_path):
    """Gemma 3's blocks (sandwich norms, GELU-tanh, local and global rope tables, windows)."""
    base = get_preset("tiny-gemma3").config
    cfg = dataclasses.replace(base, **SHAPE, vocab_size=VOCAB, query_pre_attn_scalar=None)
    _, (f,) = write_preset_gguf(tmp_path / "gemma3-BF16.gguf", "tiny-gemma3", "BF16", config=cfg)
    property_run(executor("lean", f), executor("lean", f), 12)


@pytest.mark.parametrize("make_config", [gpt_oss_config, windowed_config],
                         ids=["gpt-oss-window-sinks", "window-every-layer"])  # fmt: skip
def test_windows_and_sinks_are_batch_invariant_too(make_config):
    config = make_config()
    property_run(_in_memory(config), _in_memory(config), 12)
