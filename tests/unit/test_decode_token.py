"""The one-call decode token (csrc/decode_token.c, `tandem.kernels.lean.token`): its embedding row
against gguf-py's dequantization bit for bit, and a whole model's tokens against `LeanModel`'s
step by step path (the embedding in numpy, the layers, the norm, the head and the argmax each a
call of its own) bit for bit: logits and greedy ids, across the RoPE window's edge, for every
architecture and for embedding types dequantized in C and in numpy; for the models with windows,
sinks, experts or Gemma 3's blocks also against the layer by layer decode (two calls a layer)
and the op by op forward, across their attention window's edge too."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from tandem.engine.executor import Step, StepSequence
from tandem.engine.lean import LeanExecutor
from tandem.kernels import library
from tandem.kernels.cstructs import TqDecodePlan
from tandem.kernels.lean import ops, token
from tandem.kernels.lean.linear import Linear
from tandem.kernels.lean.rope import cos_sin
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.models.presets import get_preset

pytestmark = pytest.mark.skipif(not library.available(), reason=f"no native: {library.why()}")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
HEAD_DIM = {"tiny-llama": 64, "tiny-qwen2": 64, "tiny-qwen3": 128}
NATIVE_EMBED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def _table(rng: np.random.Generator, rows: int, D: int, name: str) -> np.ndarray:
    """A (rows, row_bytes) uint8 table of type `name` as gguf-py writes it."""
    x = (rng.standard_normal((rows, D)) * 2).astype(np.float32)
    x[0, :5] = (0.0, -0.0, 1e-30, 65000.0, -3.5)  # zeros, a subnormal-ish scale, a large one
    return np.ascontiguousarray(quantize(x, GT[name])).view(np.uint8).reshape(rows, -1)


def _plan(table: np.ndarray, type_id: int, D: int, head: Linear, norm: np.ndarray, buf):
    return TqDecodePlan(
        None, 0, 0, None, D, 1, 1, 32, 0, 1.0, norm.ctypes.data, 1e-6,
        ctypes.addressof(head.desc), head.out_features, table.ctypes.data, type_id,
        table.shape[0], table.strides[0], buf[0].ctypes.data, buf[1].ctypes.data,
        buf[2].ctypes.data, 1,
    )  # fmt: skip


@pytest.mark.parametrize("name", NATIVE_EMBED)
@pytest.mark.parametrize("D", [32, 96, 576])
def test_the_embedding_row_is_gguf_pys_dequantization(name, D) -> None:
    rng = np.random.default_rng(D)
    table = _table(rng, 7, D, name)
    head_w = _table(rng, 40, D, "Q8_0")
    head = Linear([(head_w, int(GT.Q8_0))], D, None, "head")
    norm = (rng.random(D) + 0.5).astype(np.float32)
    buf = np.zeros((3, D), np.float32)
    plan = _plan(table, int(GT[name]), D, head, norm, buf)
    lib = library.library()
    assert lib.tandem_embed_type_native(int(GT[name])) == 1
    for tok in range(7):
        logits = np.empty(40, np.float32)
        got = lib.tandem_decode_token(ctypes.addressof(plan), tok, 0, 0, None, None, None, None,
                                      logits.ctypes.data, 1)  # fmt: skip
        want = np.asarray(dequantize(table[tok : tok + 1], GT[name]), np.float32).reshape(D)
        assert np.array_equal(buf[0].view(np.uint32), want.view(np.uint32)), tok
        normed = ops.rmsnorm(want[None], norm, 1e-6, 1)
        ref = head(normed, 1)[0]
        assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32))
        assert got == int(ops.argmax(ref[None])[0])


def test_a_token_outside_the_table_or_an_unknown_type_is_refused() -> None:
    rng = np.random.default_rng(0)
    D = 64
    table = _table(rng, 3, D, "Q8_0")
    head = Linear([(_table(rng, 8, D, "Q8_0"), int(GT.Q8_0))], D, None, "head")
    norm = np.ones(D, np.float32)
    buf = np.zeros((3, D), np.float32)
    lib = library.library()
    logits = np.empty(8, np.float32)
    plan = _plan(table, int(GT.Q8_0), D, head, norm, buf)
    for tok in (3, -2):
        assert lib.tandem_decode_token(ctypes.addressof(plan), tok, 0, 0, None, None, None, None,
                                       logits.ctypes.data, 1) == -1  # fmt: skip
    assert lib.tandem_embed_type_native(int(GT.Q6_K)) == 0
    plan = _plan(table, int(GT.Q6_K), D, head, norm, buf)
    assert lib.tandem_decode_token(ctypes.addressof(plan), 0, 0, 0, None, None, None, None,
                                   logits.ctypes.data, 1) == -1  # fmt: skip


@pytest.mark.parametrize("pairs", [False, True])
def test_the_rope_window_rows_are_the_one_position_rows(pairs) -> None:
    inv = (1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64))).astype(np.float32)
    win_c, win_s = cos_sin(inv, np.arange(token.WINDOW * 3, token.WINDOW * 4), pairs)
    for i in range(token.WINDOW):
        c, s = cos_sin(inv, np.array([token.WINDOW * 3 + i]), pairs)
        assert np.array_equal(c[0], win_c[i]) and np.array_equal(s[0], win_s[i])


def _gguf(tmp_path_factory, preset: str, qtype: str):
    cfg = dataclasses.replace(get_preset(preset).config, **SHAPE, head_dim=HEAD_DIM[preset])
    out = tmp_path_factory.mktemp("token") / f"{preset}-{qtype}.gguf"
    _, (f,) = write_preset_gguf(out, preset, qtype, config=cfg)
    return f


@pytest.mark.parametrize(
    ("preset", "qtype"),
    [("tiny-llama", "Q4_0"), ("tiny-llama", "K_MIX"), ("tiny-qwen2", "Q5_1"),
     ("tiny-qwen3", "Q8_0"), ("tiny-qwen3", "Q4_1"), ("tiny-qwen3", "BF16")],
)  # fmt: skip
def test_one_call_tokens_equal_the_step_by_step_path(tmp_path_factory, preset, qtype) -> None:
    f = _gguf(tmp_path_factory, preset, qtype)
    ex = LeanExecutor.from_file(f, max_batch=3, max_seq_len=96, threads=2)
    m = ex.model
    assert m.decode_token is not None
    prompt = (5, 17, 42, 99, 3)
    for sid in (0, 1, 2):
        ex.run(Step((StepSequence(sid, prompt, 0),)))
    tok = 7
    for pos in range(len(prompt), len(prompt) + token.WINDOW + 8):  # past the window's edge
        ref = m.logits(m.forward([(2, pos, (tok,))]))  # (1, V): the step by step path
        ex.seqs.advance(Step((StepSequence(2, (tok,), pos),)))
        got = ex.run(Step((StepSequence(0, (tok,), pos),))).logits
        ids = ex.run(Step((StepSequence(1, (tok,), pos),), greedy=True)).token_ids
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), pos
        assert ids.dtype == np.int64 and ids.tolist() == [int(np.argmax(ref[0]))], pos
        tok = int(ids[0])
    assert np.array_equal(m.k[:, 0], m.k[:, 2]) and np.array_equal(m.v[:, 1], m.v[:, 2])


def test_logits_of_the_wrong_shape_or_dtype_are_refused(tmp_path_factory) -> None:
    f = _gguf(tmp_path_factory, "tiny-qwen3", "Q8_0")
    ex = LeanExecutor.from_file(f, max_batch=1, max_seq_len=16, threads=1)
    one = ex.model.decode_token
    for bad in (np.empty(one.vocab, np.float64), np.empty(one.vocab - 1, np.float32),
                np.empty((one.vocab, 2), np.float32)[:, 0]):  # fmt: skip
        with pytest.raises(ops.LeanKernelError):
            one(0, 0, 1, bad)


# small random models of the families whose layers carry more than a dense layer's parts
FAMILY_SHAPE = dict(SHAPE, intermediate_size=256, head_dim=64)
GEMMA3 = dict(num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=None, embed_scale=16.0)


def _family_gguf(tmp_path_factory, preset: str, qtype: str):
    base = get_preset(preset).config
    kw = dict(FAMILY_SHAPE, **(GEMMA3 if preset == "tiny-gemma3" else {}))
    if base.moe is not None:
        kw["moe"] = dataclasses.replace(base.moe, intermediate_size=256)
    out = tmp_path_factory.mktemp("token-family") / f"{preset}-{qtype}.gguf"
    _, (f,) = write_preset_gguf(out, preset, qtype, config=dataclasses.replace(base, **kw))
    return f


@pytest.mark.parametrize(
    ("preset", "qtype"),
    [("tiny-gemma3", "Q8_0"), ("tiny-gemma3", "K_MIX"), ("tiny-gpt-oss", "MXFP4"),
     ("tiny-gpt-oss", "Q8_0"), ("tiny-mixtral", "Q8_0"), ("tiny-qwen3-moe", "K_MIX"),
     ("tiny-qwen2-moe", "Q8_0")],
)  # fmt: skip
def test_windows_sinks_experts_and_gemma_decode_in_one_call_as_layer_by_layer(
    tmp_path_factory, monkeypatch, preset, qtype
) -> None:
    """gpt-oss (windows of 8, sinks, biased experts), Mixtral and Qwen3-MoE (experts, a dense
    layer), Qwen2-MoE (its sigmoid-gated shared expert, q/k/v biases), Gemma 3 (sandwich norms, GELU-tanh, the embedding scale, windows of 8 with their own
    RoPE table): the one call's logits and greedy ids equal `_decode_layers`' and
    `forward_steps`' bit for bit, past the attention window and the RoPE window, and no decode
    step runs the op by op path."""
    f = _family_gguf(tmp_path_factory, preset, qtype)
    ex = LeanExecutor.from_file(f, max_batch=4, max_seq_len=96, threads=2)
    m = ex.model
    assert m.decode_token is not None
    special = [L for L in m.layers if L.window or L.moe is not None or L.attn_out_norm is not None]
    assert special, preset  # the one call carries these layers' parts
    prompt = (5, 17, 42, 99, 3)
    for sid in (0, 1, 2, 3):
        ex.run(Step((StepSequence(sid, prompt, 0),)))
    stepped = []
    real = m.forward_steps
    monkeypatch.setattr(m, "forward_steps", lambda rows: stepped.append(rows) or real(rows))
    tok = 7
    for pos in range(len(prompt), len(prompt) + token.WINDOW + 8):
        layered = m.logits(m._decode_layers(2, pos, tok))  # (1, V): two calls a layer
        ex.seqs.advance(Step((StepSequence(2, (tok,), pos),)))
        op_by_op = m.logits(real([(3, pos, (tok,))]))
        ex.seqs.advance(Step((StepSequence(3, (tok,), pos),)))
        got = ex.run(Step((StepSequence(0, (tok,), pos),))).logits
        ids = ex.run(Step((StepSequence(1, (tok,), pos),), greedy=True)).token_ids
        assert np.array_equal(got.view(np.uint32), layered.view(np.uint32)), pos
        assert np.array_equal(got.view(np.uint32), op_by_op.view(np.uint32)), pos
        assert ids.tolist() == [int(np.argmax(layered[0]))], pos
        tok = int(ids[0])
    assert not stepped
    for a in (m.k, m.v):
        assert np.array_equal(a[:, 0], a[:, 2]) and np.array_equal(a[:, 1], a[:, 3])
