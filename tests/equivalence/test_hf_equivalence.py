"""tandem's reference model equals Hugging Face `transformers` (a peer we did not write) on
random-init models of every supported architecture: f32 logits within 1e-4, and identical greedy ids
for 32 new tokens at batch 1 and at batch 3 with prompts of different lengths. The mixture-of-experts
families (Qwen3-MoE with a dense layer among sparse ones and norm_topk_prob off, Qwen2-MoE with
q/k/v biases, a dense layer and its sigmoid-gated shared expert, Mixtral) load
from the per-expert tensors transformers writes; gpt-oss (biased router, clamped SwiGLU experts
with biases, attention sinks, a sliding window of 6 on every other layer, YaRN) from its fused,
transposed and interleaved expert tensors. Gemma 3 (sandwich norms, a window of 8 on its local
layers, their own rope base) crosses its window in prefill and in decode. Phi-3 loads from its
fused qkv_proj / gate_up_proj, with a sliding window the generation crosses, and as Phi-4-mini
with partial rotary and longrope whose switch to the long factor set every prompt crosses while
generating. The Qwen3.5 hybrid, dense and MoE (Gated DeltaNet layers prefilled in chunks and
decoded token by token from the state each sequence's cache slot holds; gated attention with
partial rotary; the shared expert), and its prefill across several chunks."""

import pytest
import torch
import transformers
from hf_init import spread_

from tandem.engine.executor import Step, StepSequence
from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import ModelDir

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

QWEN35_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
)
ARCHS = {
    "llama-untied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False),
    ),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral-sliding-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=1, head_dim=16, sliding_window=24),
    ),
    "qwen2-qkv-bias": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    "qwen3-qk-norm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3-moe-dense-layer": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    # q/k/v biases, norm_topk_prob off, the sigmoid-gated shared expert, a dense layer (1)
    "qwen2-moe-shared-expert": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
        ),
    ),
    "gpt-oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=48,
            sliding_window=6,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=8.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=32,
            ),  # fmt: skip
        ),
    ),
    # 5 local layers : 1 global (7 layers: both kinds, a local one after the global), MQA, a
    # window of 8 crossed in prefill and decode, local and linearly scaled global rope, sandwich
    # norms, GELU-tanh, an attention scalar other than head_dim
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            num_hidden_layers=7,
            num_key_value_heads=1,
            sliding_window=8,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
        ),
    ),
    # fused qkv_proj / gate_up_proj split at load, no biases, a sliding window crossed by the
    # prompts + 32 tokens
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(sliding_window=20, original_max_position_embeddings=256),
    ),
    # Phi-4-mini's partial rotary (12 of 16 dims) and longrope switching to its long set past
    # 16 tokens: every prompt crosses it while generating
    "phi3-partial-longrope": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            partial_rotary_factor=0.75,
            original_max_position_embeddings=16,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                long_factor=[1.0, 2.0, 3.0, 5.0, 7.0, 9.0],
            ),
            tie_word_embeddings=True,
        ),
    ),
    # the Qwen3.5 hybrid: Gated DeltaNet on layers 0-2 and 4 (2 q/k heads of 8 serving 4 v heads
    # of 12, a conv window of 4), gated attention with partial rotary on 3; 41 tokens cross no
    # chunk edge of 64, so a long prompt in `test_qwen35_chunked_prefill_crosses_chunks` does
    "qwen35": (
        transformers.Qwen3_5TextConfig,
        transformers.Qwen3_5ForCausalLM,
        dict(head_dim=16, num_hidden_layers=5, **QWEN35_LINEAR),
    ),
    # every layer sparse, with the sigmoid-gated shared expert
    "qwen35-moe": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(
            head_dim=16,
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            **QWEN35_LINEAR,
        ),
    ),
    "mixtral-moe": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48),
    ),
}

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 7], [42, 43, 44, 45, 46]]
# transformers picks longrope's factor set for a whole batch by its longest (padded) row; tandem
# per sequence, as transformers does at batch 1: a batch is compared with each prompt alone
PER_SEQUENCE = {"phi3-partial-longrope"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    """(HF model, tandem model loaded from the directory HF saved, the ARCHS key)."""
    cfg_cls, model_cls, extra = ARCHS[request.param]
    torch.manual_seed(1234)
    cfg = cfg_cls(**{**SMALL, **extra}, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf = spread_(model_cls(cfg).eval(), matrix_std=0.25)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d, safe_serialization=True)
    ours = load_model(ModelDir(d), dtype=torch.float32)
    return hf, ours, request.param


@torch.inference_mode()
def test_last_position_logits_match_transformers_within_1e_4_in_float32(pair):
    hf, ours, _ = pair
    ex = LocalExecutor(ours, max_batch=3, max_seq_len=64)
    step = Step(tuple(StepSequence(i, tuple(p), 0) for i, p in enumerate(PROMPTS)))
    logits = ex.run(step).logits
    for row, p in enumerate(PROMPTS):
        ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=0)
    full = ours(torch.tensor([PROMPTS[0]]))
    torch.testing.assert_close(full, hf(torch.tensor([PROMPTS[0]])).logits, atol=1e-4, rtol=0)


@torch.inference_mode()
def hf_greedy(hf, prompts, n):
    """transformers' generate, left-padded with an attention mask."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p)
        mask[b, T - len(p) :] = 1
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, T:].tolist()


def test_greedy_ids_match_transformers_for_32_tokens_at_batch_1_and_3(pair):
    hf, ours, arch = pair
    params = SamplingParams(max_tokens=32, temperature=0.0)
    ex = LocalExecutor(ours, max_batch=3, max_seq_len=64)
    single = generate(ex, [PROMPTS[0]], params)[0].token_ids
    assert single == hf_greedy(hf, [PROMPTS[0]], 32)[0]
    batch = [r.token_ids for r in generate(ex, PROMPTS, params)]
    assert batch[0] == single
    if arch in PER_SEQUENCE:
        assert batch == [hf_greedy(hf, [p], 32)[0] for p in PROMPTS]
    else:
        assert batch == hf_greedy(hf, PROMPTS, 32)


@pytest.mark.parametrize("arch", ["qwen35"])
@torch.inference_mode()
def test_qwen35_chunked_prefill_crosses_chunks_and_decodes_from_its_state(arch, tmp_path):
    """A 150-token prompt (three chunks of the delta rule) prefilled in one step and in uneven
    pieces (state carried across steps), then 8 decode steps: each last-position logits row
    within 1e-4 of transformers' full forward over the same tokens."""
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(99)
    cfg = cfg_cls(**{**SMALL, **extra}, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf = model_cls(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(ModelDir(tmp_path), dtype=torch.float32)
    prompt = torch.randint(
        1, SMALL["vocab_size"], (150,), generator=torch.Generator().manual_seed(3)
    )
    ex = LocalExecutor(ours, max_batch=2, max_seq_len=200, kernels="torch")
    whole = ex.run(Step((StepSequence(0, tuple(prompt.tolist()), 0),))).logits[0]
    ref = hf(prompt[None]).logits[0, -1]
    torch.testing.assert_close(whole, ref, atol=1e-4, rtol=0)
    pos, tokens = 0, prompt.tolist()
    for n in (70, 1, 64, 15):  # pieces of 150
        out = ex.run(Step((StepSequence(1, tuple(tokens[pos : pos + n]), pos),))).logits[0]
        pos += n
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    for _ in range(8):
        tokens.append(int(out.argmax()))
        out = ex.run(Step((StepSequence(1, (tokens[-1],), len(tokens) - 1),))).logits[0]
        torch.testing.assert_close(out, hf(torch.tensor([tokens])).logits[0, -1], atol=1e-4, rtol=0)
