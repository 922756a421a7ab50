"""The Qwen3.5 hybrid from GGUF (`qwen35`, `qwen35moe`, written by tandem's writer with gguf-py
in llama.cpp's converter layout: v heads tiled, A = -exp(A_log), norms 1 + w, the conv squeezed),
dense and MoE, against transformers (which does not read these files):

    F32    the file of a random transformers model: logits within 1e-4 of transformers on the
           model's own weights, 32 greedy ids at batch 1 and 3 equal
    Q8_0   the file's weights dequantized by gguf-py and put back in HF's layout (this test's
           own inverse of the layout above) into the transformers model: logits within 1e-4 of
           that model, 32 greedy ids at batch 1 and 3 equal. Q8_0's own error (a scale per 32
           weights, |w - q| <= scale / 2) is then what separates the file from the original
           model, and nothing else (tandem on its reference modules over the blocks, as the
           other GGUF equivalence tests: the native kernels' int8 activations have their own
           bound and tests).

llama.cpp is not run here (CI has none): scripts/bench/qwen35_llamacpp.py compares tandem's greedy
ids with llama.cpp's on files its own converter wrote, and checks tandem's writer against that
converter. (llama.cpp takes the DeltaNet v head width from ssm.state_size, i.e. dv = dk, so it
refuses these tiny files, whose dv is not dk.)"""

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize
from hf_init import spread_

from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.gguf.names import hf_name
from tandem.loaders.gguf.writer import write_model_dir_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.families.qwen3_5_gguf import GGUF_NAMES

SHAPE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           shared_expert_intermediate_size=32)  # fmt: skip
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 7], [42, 43, 44, 45, 46]]


@pytest.fixture(scope="module", params=["dense", "moe"])
def saved(request, tmp_path_factory):
    """(transformers model, its directory, the GGUF files by type)."""
    if request.param == "moe":
        cfg = transformers.Qwen3_5MoeTextConfig(**SHAPE, **MOE)
        hf = transformers.Qwen3_5MoeForCausalLM(cfg)
    else:
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE))
    torch.manual_seed(7)
    spread_(hf)
    d = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    hf.eval().save_pretrained(d / "hf", safe_serialization=True)
    files = {q: write_model_dir_gguf(d / "hf", d / f"m-{q}.gguf", q)[0] for q in ("F32", "Q8_0")}
    return hf, files


def _untile(x: torch.Tensor, dim: int, hk: int, r: int, width: int) -> torch.Tensor:
    """Tiled v heads ([r, Hk] order) back to HF's grouped ([Hk, r]) along `dim`."""
    shape = list(x.shape)
    x = x.reshape(*shape[:dim], r, hk, width, *shape[dim + 1 :])
    return x.transpose(dim, dim + 1).reshape(shape)


def dequantized_state(path, cfg) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized by gguf-py, in transformers' names and layout."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    out: dict[str, torch.Tensor] = {}
    for t in gguf.GGUFReader(path).tensors:
        x = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        name = hf_name(t.name, GGUF_NAMES)
        leaf = name.split(".linear_attn.")[-1]
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            x = x - 1.0
        elif leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            x = torch.cat([x[: 2 * hk * dk], _untile(x[2 * hk * dk :], 0, hk, r, dv)])
            x = x.reshape(x.shape[0], 1, -1) if leaf == "conv1d.weight" else x
        elif leaf == "in_proj_z.weight":
            x = _untile(x, 0, hk, r, dv)
        elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias"):
            x = _untile(x, 0, hk, r, 1)
        elif leaf == "A_log":
            x = _untile(torch.log(-x), 0, hk, r, 1)
        elif leaf == "out_proj.weight":
            x = _untile(x, 1, hk, r, dv)
        out[name] = x
    for key in [k for k in out if k.endswith("mlp.experts.gate_proj.weight")]:
        p = key.removesuffix("gate_proj.weight")  # transformers holds gate and up fused
        out[p + "gate_up_proj"] = torch.cat([out.pop(key), out.pop(p + "up_proj.weight")], 1)
        out[p + "down_proj"] = out.pop(p + "down_proj.weight")
    return out


@torch.inference_mode()
def hf_greedy(hf, prompts, n=32):
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = torch.tensor(p), 1
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                      pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[:, T:].tolist()


def _matches(hf, path, kernels: str = "auto") -> None:
    ours = load_model(open_model(path))
    assert ours.config.deltanet.v_tiled and not ours.config.deltanet.a_log
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    ex = LocalExecutor(ours, max_batch=3, max_seq_len=64, kernels=kernels)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    assert generate(ex, [PROMPTS[0]], params)[0].token_ids == hf_greedy(hf, [PROMPTS[0]])[0]
    assert [r.token_ids for r in generate(ex, PROMPTS, params)] == hf_greedy(hf, PROMPTS)


def test_an_f32_file_equals_transformers_on_the_models_weights(saved):
    hf, files = saved
    _matches(hf, files["F32"])


def test_a_q8_0_file_equals_transformers_on_its_dequantized_weights(saved):
    hf, files = saved
    state = dequantized_state(files["Q8_0"], hf.config)
    moved = type(hf)(hf.config).eval()
    missing, unexpected = moved.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state)
    changed = max(
        (state[k] - v).abs().max().item() for k, v in hf.state_dict().items() if k in state
    )
    assert changed > 0  # Q8_0 moved the weights: the comparison is against what the file holds
    # the reference modules over the blocks (dequantize, then F.linear): what transformers
    # computes; the native quantized kernels round activations to int8 and are held to the
    # reference within their own bound (tests/unit/test_quant_gemv.py, test_quant_linear.py)
    _matches(moved, files["Q8_0"], kernels="torch")
