"""A gpt-oss checkpoint in OpenAI's MXFP4 layout (`tiny-gpt-oss-mxfp4`: the experts'
`gate_up_proj_blocks` / `_scales` and `down_proj_blocks` / `_scales` written with tandem's MXFP4
quantizer, the rest bfloat16, config.json `quantization_config` "mxfp4") against transformers
reading the same directory with its own MXFP4 dequantization (`Mxfp4Config(dequantize=True)`,
float32, CPU): tandem keeps the experts as MXFP4 blocks, and those blocks dequantize to exactly
transformers' experts; both then compute in float32 on the same values, so the logits agree
within LOGIT_ATOL (the reference quantized modules) and 32 greedy ids are equal at batch 1 and 3.
"""

import pytest
import torch
import transformers
from test_hf_equivalence import hf_greedy
from transformers import Mxfp4Config

from tandem.engine.executor import Step, StepSequence
from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.mxfp4_dir import Mxfp4ModelDir
from tandem.loaders.source import open_model
from tandem.models.quant.dequant import dequantize
from tandem.models.quant.linear import QuantExpertLinear

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 7], [42, 43, 44, 45, 46]]
LOGIT_ATOL = 1e-4  # measured: 8.6e-6 on logits up to 17 (float32 summation order only)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, tandem's model, tandem's source) from one MXFP4 directory."""
    d = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "m"
    make_model_dir(d, "tiny-gpt-oss-mxfp4")
    hf = transformers.GptOssForCausalLM.from_pretrained(
        d, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    src = open_model(d)
    assert isinstance(src, Mxfp4ModelDir)
    return hf, load_model(src, dtype=torch.float32), src


def test_loaded_experts_are_mxfp4_blocks_that_dequantize_to_transformers_experts_exactly(pair):
    hf, ours, _ = pair
    state = hf.state_dict()
    for i, layer in ours.model.layers.items():
        experts = layer.mlp.experts
        base = f"model.layers.{i}.mlp.experts."
        theirs = {
            "gate_proj": state[base + "gate_up_proj"][..., 0::2],  # (E, D, 2I): gate columns
            "up_proj": state[base + "gate_up_proj"][..., 1::2],
            "down_proj": state[base + "down_proj"],  # (E, I, D)
        }
        for proj, want in theirs.items():
            mod = getattr(experts, proj)
            assert isinstance(mod, QuantExpertLinear) and mod.qweight.dtype == torch.uint8
            got = dequantize(mod.qweight.reshape(-1, mod.qweight.shape[-1]), mod.qtype)
            got = got.view(mod.n_experts, mod.out_features, mod.in_features)
            assert torch.equal(got, want.transpose(1, 2)), f"layer {i} {proj}"


@torch.inference_mode()
def test_logits_match_transformers_within_1e_4_at_batch_1_and_3(pair):
    hf, ours, _ = pair
    ex = LocalExecutor(ours, max_batch=3, max_seq_len=64, kernels="torch")
    step = Step(tuple(StepSequence(i, tuple(p), 0) for i, p in enumerate(PROMPTS)))
    logits = ex.run(step).logits
    ex.runner.release(list(range(len(PROMPTS))))
    for row, p in enumerate(PROMPTS):
        ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=LOGIT_ATOL, rtol=0)
    full = ours(torch.tensor([PROMPTS[0]]))
    want = hf(torch.tensor([PROMPTS[0]])).logits
    torch.testing.assert_close(full, want, atol=LOGIT_ATOL, rtol=0)


def test_greedy_ids_match_transformers_for_32_tokens_at_batch_1_and_3(pair):
    hf, ours, _ = pair
    params = SamplingParams(max_tokens=32, temperature=0.0)
    ex = LocalExecutor(ours, max_batch=3, max_seq_len=64, kernels="torch")
    single = generate(ex, [PROMPTS[0]], params)[0].token_ids
    assert single == hf_greedy(hf, [PROMPTS[0]], 32)[0]
    batch = [r.token_ids for r in generate(ex, PROMPTS, params)]
    assert batch[0] == single
    assert batch == hf_greedy(hf, PROMPTS, 32)
