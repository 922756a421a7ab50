"""The Qwen3.5 hybrid (GGUF `qwen35`, and `qwen35moe`: every FFN the MoE block with its
sigmoid-gated shared expert, `kernels.lean.moe`) on the torch-free path: its Gated DeltaNet
layers on csrc/deltanet.c (`kernels.lean.deltanet`), its gated attention and (1 + w) norms in
`LeanModel`.

The mixer against the torch reference (`models.deltanet.GatedDeltaNet`) on an F32 file: both
multiply the same float32 weights, so they differ only in summation order (the conv taps, the
l2 and rms sums, S^T k and S^T q, the chunked against the recurrent form): within MIXER_ATOL.
The whole model against `LocalExecutor` on the same quantized file within the lean path's bound
(tests/unit/test_lean_executor.py states it: 2 delta + LOGIT_ATOL), and 32 greedy ids equal.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_lean_executor import _assert_like_local

from tandem.engine.executor import Step, StepSequence
from tandem.engine.lean import LeanExecutor
from tandem.engine.local import LocalExecutor
from tandem.engine.sequences import PrefixCopyError, RecurrentRewindError
from tandem.kernels import native
from tandem.kernels.lean import ops
from tandem.kernels.lean.deltanet import DeltaNetMixer
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.models.presets import get_preset

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native: {native.why()}")

MIXER_ATOL = 5e-6  # float32 summation order over 12 tokens, outputs ~0.7 (measured 5e-7)
# Q8_0: v heads of 32 (out_proj in Q8_0 blocks); K_MIX: the Q4_K_M mix at whole superblocks
SHAPES = {
    "Q8_0": (dict(value_head_dim=32), {}),
    "K_MIX": (
        dict(num_key_heads=4, num_value_heads=8, value_head_dim=128),
        dict(hidden_size=256, intermediate_size=512),
    ),
}
# the dense hybrid in both shapes; with experts (qwen35moe) in Q8_0
CASES = [(q, "tiny-qwen35") for q in SHAPES] + [("Q8_0", "tiny-qwen35-moe")]
# prefills of two lengths, decode tokens of both, single-sequence decodes, a restart from 0
STEPS = [
    Step((StepSequence(0, (5, 17, 42, 99, 3, 7, 250, 11), 0), StepSequence(1, (300, 1, 2), 0))),
    Step((StepSequence(0, (9,), 8), StepSequence(1, (4,), 3))),
    Step((StepSequence(0, (12,), 9),)),
    Step((StepSequence(1, (6, 7), 4),)),
    Step((StepSequence(0, (13,), 10),)),
    Step((StepSequence(0, (1, 2, 3), 0),)),  # a replay from 0: the held state is discarded
    Step((StepSequence(0, (8,), 3),)),
]


def _file(tmp_path_factory, qtype: str, shape: str, preset: str = "tiny-qwen35"):
    deltanet, dims = SHAPES[shape]
    c = get_preset(preset).config
    c = dataclasses.replace(c, deltanet=dataclasses.replace(c.deltanet, **deltanet), **dims)
    out = tmp_path_factory.mktemp("lean-hybrid") / f"{preset}-{qtype}.gguf"
    return write_preset_gguf(out, preset, qtype, config=c, seed=5)[1][0]


@torch.inference_mode()
def test_the_native_deltanet_mixer_equals_the_torch_layer(tmp_path_factory) -> None:
    """Layer 0 of an F32 file (v heads tiled, A stored), 12 tokens from a zero state: one
    native call a token (`step`, the decode) and all 12 in one (`prefill`), against the torch
    layer's chunked forward on the same normed input."""
    src = GGUFModel(_file(tmp_path_factory, "F32", "Q8_0"))
    c = src.config
    assert c.deltanet.v_tiled and not c.deltanet.a_log
    model = load_model(src).eval()
    layer = model.model.layers["0"]
    T = 12
    h = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(0))
    want = layer.linear_attn(layer.input_layernorm(h), model.context([0], [T]))[0].numpy()

    in_norm = (np.float32(c.norm_weight_offset or 0) + layer.input_layernorm.weight.numpy()).astype(
        np.float32
    )
    mixer = DeltaNetMixer(src, 0, c, in_norm)
    (ws, ss), x = mixer.state_shapes(), h[0].numpy()
    window, state = np.zeros(ws, np.float32), np.zeros(ss, np.float32)
    stepped = np.concatenate([mixer.step(x[t : t + 1].copy(), window, state, 2) for t in range(T)])
    np.testing.assert_allclose(stepped, want, rtol=0, atol=MIXER_ATOL)

    w2, s2 = np.zeros(ws, np.float32), np.zeros(ss, np.float32)
    xn = ops.rmsnorm(x, in_norm, c.rms_norm_eps, 2)
    whole = mixer.prefill(xn, np.array([0, T]), [(w2, s2)], 2)
    np.testing.assert_allclose(whole, want, rtol=0, atol=MIXER_ATOL)
    # the two native forms carry the same window and, within rounding, the same state
    np.testing.assert_array_equal(w2, window)
    np.testing.assert_allclose(s2, state, rtol=0, atol=MIXER_ATOL)


@pytest.mark.parametrize(("qtype", "preset"), CASES)
def test_a_qwen35_file_runs_torch_free_like_the_local_executor(
    tmp_path_factory, qtype, preset
) -> None:
    """Batches of prefills and decode tokens, single-sequence decodes (a DeltaNet layer one
    native call) and a replay from 0, each step's logits within the lean bound of the torch
    path's on the same file; a rewind elsewhere is refused as the torch path refuses it.
    qwen35moe: every layer's FFN the MoE block with its sigmoid-gated shared expert."""
    f = _file(tmp_path_factory, qtype, qtype, preset)
    lean = LeanExecutor.from_file(f, max_batch=2, max_seq_len=64, threads=2)
    assert lean.model.hybrid and lean.model.decode_token is None
    assert sum(L.deltanet is not None for L in lean.model.layers) == 3
    sparse = [L.moe is not None and L.moe.shared is not None for L in lean.model.layers]
    assert sparse == [preset == "tiny-qwen35-moe"] * len(sparse)
    _assert_like_local(f, lean, STEPS)
    with pytest.raises(RecurrentRewindError):
        lean.run(Step((StepSequence(0, (2,), 2),)))


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35-moe"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_qwen35_file_decodes_the_torch_paths_greedy_ids(tmp_path_factory, batch, preset) -> None:
    """32 greedy tokens after a prompt each, one sequence (the one-call DeltaNet step) and three
    together (the batched form), torch-free and on the torch path: the same ids (dense and
    with experts)."""
    f = _file(tmp_path_factory, "Q8_0", "Q8_0", preset)
    prompts = [(5, 17, 42, 99, 3), (300, 1, 2, 8, 9, 10, 11), (7,)][:batch]
    got = []
    for ex in (
        LeanExecutor.from_file(f, max_batch=3, max_seq_len=64, threads=2),
        LocalExecutor.from_dir(f, max_batch=3, max_seq_len=64),
    ):
        ids = [list(p) for p in prompts]
        seqs = [StepSequence(i, p, 0) for i, p in enumerate(prompts)]
        for _ in range(32):
            out = ex.run(Step(tuple(seqs), greedy=True)).token_ids
            out = [int(t) for t in (out.tolist() if hasattr(out, "tolist") else out)]
            for i, t in enumerate(out):
                ids[i].append(t)
            seqs = [StepSequence(i, (t,), len(ids[i]) - 1) for i, t in enumerate(out)]
        got.append(ids)
    assert got[0] == got[1]
    assert len({tuple(s[-32:]) for s in got[0]}) == batch  # the rows decode their own tokens


def test_a_whole_copy_carries_the_deltanet_state_and_a_partial_one_is_refused(
    tmp_path_factory,
) -> None:
    """A hybrid sequence copied whole (its KV, conv windows and matrices) continues as its source
    does, bit for bit; a copy of fewer positions is `PrefixCopyError`, as on the torch path."""
    f = _file(tmp_path_factory, "Q8_0", "Q8_0")
    lean = LeanExecutor.from_file(f, max_batch=3, max_seq_len=64, threads=2)
    lean.run(STEPS[0])
    lean.copy_prefix(0, 2, 8)
    with pytest.raises(PrefixCopyError):
        lean.copy_prefix(1, 3, 2)
    a = lean.run(Step((StepSequence(0, (9,), 8),))).logits
    b = lean.run(Step((StepSequence(2, (9,), 8),))).logits
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tiled", [False, True])
@torch.inference_mode()
def test_the_native_recurrence_equals_the_torch_mixer_in_either_v_head_order(tiled) -> None:
    """csrc tandem_deltanet_mix against `models.deltanet.GatedDeltaNet` (random float32 weights,
    A_log stored, 2 q/k heads serving 6 v heads grouped as HF orders them or tiled as a GGUF
    does): 25 tokens as 20 then 5 from the carried window and state equal the torch mixer's
    chunked forward over all 25 within MIXER_ATOL."""
    from tandem.kernels import library
    from tandem.models.deltanet import GatedDeltaNet

    c = get_preset("tiny-qwen35").config
    spec = dataclasses.replace(c.deltanet, num_value_heads=6, v_tiled=tiled, a_log=True)
    c = dataclasses.replace(c, deltanet=spec)
    torch.manual_seed(1)
    net = GatedDeltaNet(c, 0)
    for prm in net.parameters():
        prm.copy_(torch.randn_like(prm) * 0.3)
    T, Hv, dv = 25, spec.num_value_heads, spec.value_head_dim
    x = torch.randn(1, T, c.hidden_size)
    from tandem.models.context import build_context
    from tandem.models.rope import RotaryEmbedding

    ctx = build_context(RotaryEmbedding(c), [0], [T], dtype=torch.float32)
    want = net(x, ctx)[0].numpy()  # (T, D)

    w = torch.cat([net.in_proj_qkv.weight, net.in_proj_z.weight, net.in_proj_b.weight,
                   net.in_proj_a.weight])  # fmt: skip
    proj = (x[0] @ w.T).numpy()  # (T, P)
    conv_w = np.ascontiguousarray(net.conv1d.weight[:, 0].numpy())  # (C, K)
    A = np.ascontiguousarray(-np.exp(net.A_log.numpy()))
    dt, norm_w = net.dt_bias.numpy().copy(), net.norm.weight.numpy().copy()
    window = np.zeros((spec.conv_dim, spec.conv_kernel - 1), np.float32)
    state = np.zeros((Hv, spec.key_head_dim, dv), np.float32)
    y = np.empty((T, Hv * dv), np.float32)
    for r0, r1 in ((0, 20), (20, T)):
        part = np.ascontiguousarray(proj[r0:r1])
        out = np.empty((r1 - r0, Hv * dv), np.float32)
        rc = library.library().tandem_deltanet_mix(
            part.ctypes.data, part.shape[1], r1 - r0, conv_w.ctypes.data, A.ctypes.data,
            dt.ctypes.data, norm_w.ctypes.data, c.rms_norm_eps, window.ctypes.data,
            state.ctypes.data, out.ctypes.data, spec.num_key_heads, Hv, spec.key_head_dim, dv,
            spec.conv_kernel, int(tiled), 2,
        )  # fmt: skip
        assert rc == 0
        y[r0:r1] = out
    got = y @ net.out_proj.weight.numpy().T
    np.testing.assert_allclose(got, want, rtol=0, atol=MIXER_ATOL)


@pytest.mark.parametrize("tiled", [False, True])
def test_the_native_recurrence_gives_the_same_bits_in_one_call_token_by_token_and_on_one_thread(
    tiled,
) -> None:
    """csrc tandem_deltanet_mix is batch-invariant: 70 tokens (past its 64-token block) in one
    call on 2 threads, one call a token on 2 threads, and one call on 1 thread leave the same
    output, window and state bits (each head's state is walked by rows in a fixed order,
    whatever the block, the thread split or the token count)."""
    from tandem.kernels import library

    Hk, Hv, dk, dv, K, T = 2, 6, 16, 24, 4, 70
    C = 2 * Hk * dk + Hv * dv
    P = C + Hv * dv + 2 * Hv
    rng = np.random.default_rng(3)
    proj = rng.standard_normal((T, P)).astype(np.float32)
    conv_w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    A = -np.exp(rng.standard_normal(Hv)).astype(np.float32)
    dt = rng.standard_normal(Hv).astype(np.float32)
    norm_w = rng.standard_normal(dv).astype(np.float32)

    def run(pieces: list[tuple[int, int]], threads: int):
        window = np.zeros((C, K - 1), np.float32)
        state = np.zeros((Hv, dk, dv), np.float32)
        y = np.empty((T, Hv * dv), np.float32)
        for r0, r1 in pieces:
            part = np.ascontiguousarray(proj[r0:r1])
            out = np.empty((r1 - r0, Hv * dv), np.float32)
            rc = library.library().tandem_deltanet_mix(
                part.ctypes.data, P, r1 - r0, conv_w.ctypes.data, A.ctypes.data, dt.ctypes.data,
                norm_w.ctypes.data, 1e-6, window.ctypes.data, state.ctypes.data,
                out.ctypes.data, Hk, Hv, dk, dv, K, int(tiled), threads,
            )  # fmt: skip
            assert rc == 0
            y[r0:r1] = out
        return y, window, state

    whole = run([(0, T)], 2)
    assert np.isfinite(whole[0]).all() and np.abs(whole[2]).max() > 0
    for other in (run([(t, t + 1) for t in range(T)], 2), run([(0, T)], 1)):
        for a, b in zip(whole, other):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
