"""Gemma 3 on the execution path `tandem generate` and `serve` build (`kernels.prepare`): its
blocks keep the reference math (the fast modules replace the Llama classes by exact type), its
linear layers the native kernels, and neither the one-call decode of the model nor the two-call
decode of a layer takes a Gemma layer; the prepared model's logits equal the reference's over a
prefill past the window of 8 and decode steps beyond it."""

import copy

import torch

from tandem.engine.executor import Step, StepSequence
from tandem.engine.local import LocalExecutor
from tandem.kernels import decode_layer, decode_model
from tandem.models.context import build_context
from tandem.models.gemma import GemmaAttention, SandwichDecoderLayer
from tandem.models.kv_cache import KVCache
from tandem.models.layers import GeluTanhMLP, GemmaRMSNorm
from tandem.models.llama import Transformer
from tandem.models.presets import get_preset, random_weights

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 11 tokens: past the window of 8


def _reference() -> Transformer:
    config = get_preset("tiny-gemma3").config
    model = Transformer(config)
    model.load_state_dict(random_weights(config, 0, torch.float32), strict=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _greedy_logits(ex, steps: int) -> list[torch.Tensor]:
    seq, pos, out = list(PROMPT), 0, []
    for _ in range(steps):
        logits = ex.run(Step((StepSequence(4, tuple(seq[pos:]), pos),))).logits[0]
        pos = len(seq)
        seq.append(int(logits.argmax()))
        out.append(logits.float())
    return out


@torch.inference_mode()
def test_the_prepared_model_gives_the_references_logits_and_keeps_gemmas_blocks(monkeypatch):
    ref = _reference()
    taken = []
    real = decode_model.run
    monkeypatch.setattr(decode_model, "run", lambda *a: taken.append(real(*a)) or taken[-1])
    monkeypatch.setattr(decode_layer, "run", lambda *a: taken.append("layer"))
    fast = LocalExecutor(copy.deepcopy(ref), max_batch=1, max_seq_len=64)  # kernels "auto"
    got = _greedy_logits(fast, 12)
    assert taken and all(t is None for t in taken)  # every decode step on the modules
    want = _greedy_logits(LocalExecutor(ref, max_batch=1, max_seq_len=64, kernels="torch"), 12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    kinds = {type(m) for m in fast.model.modules()}
    assert {SandwichDecoderLayer, GemmaAttention, GemmaRMSNorm, GeluTanhMLP} <= kinds


def test_a_gemma_layer_is_never_eligible_for_the_native_decode_halves():
    model = _reference()
    from tandem.kernels.prepare import prepare

    prepare(model)
    c = model.config
    cache = KVCache(
        range(c.num_hidden_layers), 1, 32, c.num_key_value_heads, c.head_dim, torch.float32
    )
    ctx = build_context(
        model.rope, [3], [1], dtype=torch.float32, cache=cache, slots=[0],
        sliding_window=8, window_everywhere=False,
    )  # fmt: skip
    h = torch.zeros(1, model.config.hidden_size)
    assert not any(decode_layer.eligible(la, h, ctx) for la in model.model.layers.values())


@torch.inference_mode()
def test_a_multimodal_checkpoint_loads_its_text_model_equal_to_transformers(tmp_path):
    """A Gemma3ForConditionalGeneration saved by transformers (text weights under
    `language_model.`, a vision tower beside them): its text model's logits on a text prompt."""
    import transformers

    from tandem.loaders.load import load_model
    from tandem.loaders.safetensors_dir import ModelDir

    text = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, max_position_embeddings=256,
    )  # fmt: skip
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=37,
        num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    for p in hf.parameters():
        p.normal_(0, 0.25) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    md = ModelDir(tmp_path)
    assert md.config.architecture == "Gemma3ForCausalLM"
    ids = torch.tensor([PROMPT])
    torch.testing.assert_close(load_model(md)(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=0)
