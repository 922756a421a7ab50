"""Writes GGUF files with gguf-py's `GGUFWriter`: from HF-named float tensors (a random-weight
preset, or an HF model directory), quantized per tensor to a ggml type, laid out as llama.cpp's
`convert_hf_to_gguf.py` + `llama-quantize` would: architecture metadata, the `llama` q/k row
permutation (`names.permute_rows`, so a loader must undo it), 1-D tensors (norms, biases) in
F32, llama3 rope scaling as a `rope_freqs` tensor, a family's own keys and stored form
(`Family.gguf_write`, `gguf_store`: gemma3's norms as 1 + w; phi3's rotary width, longrope
factor tensors and window), a family's fused projections fused (`Family.fused_rows`: phi3's
`attn_qkv`, `ffn_up`), and a `gpt2` tokenizer (tokens, token types,
merges, special ids, chat template) when the model has a byte-level BPE tokenizer.

`qtype` names one ggml type for every matrix ("Q8_0", "Q4_K", "F16", ...) or the mix
"K_MIX" (Q4_K, with Q5_K for attn_output / ffn_down and Q6_K for attn_v and the output matrix:
the shape of a Q4_K_M file). A matrix whose row is not whole blocks falls back as llama.cpp does
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, 32-element types -> F16).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, RopeScalingType, TokenType
from tokenizers import Tokenizer as HFTokenizer

from tandem.config import ModelConfig
from tandem.loaders.fused_rows import fuse, rules_for
from tandem.loaders.gguf.names import ROPE_FREQS, gguf_name, permute_rows, permuted_heads
from tandem.loaders.gguf.tensor_types import K_MIX as K_MIX  # re-exported: the mix's name
from tandem.loaders.gguf.tensor_types import GGUFWriteError, tensor_type
from tandem.loaders.tokenizer_build import (
    SPECIAL_TOKENS,
    build_byte_bpe,
    tokenizer_config,
    word_token_ids,
)
from tandem.models.presets import get_preset, hot_rows, random_weights
from tandem.models.quant.blocks import BY_NAME
from tandem.models.quant.quantize import quantize


def write_gguf(
    out: str | Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    qtype: str = "Q8_0",
    tokenizer: HFTokenizer | None = None,
    tokenizer_cfg: dict[str, Any] | None = None,
    split_max_tensors: int = 0,
    name: str = "tandem",
) -> list[Path]:
    """Writes `out` (or its split parts `out-0000i-of-0000N.gguf` when `split_max_tensors`
    caps the tensors per file); returns the files written."""
    family = config.family
    if family.gguf_arch is None:
        raise GGUFWriteError(f"GGUF architecture for {config.architecture} is not supported")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(out, family.gguf_arch, split_max_tensors=split_max_tensors)
    _metadata(w, config, name)
    if tokenizer is not None:
        _tokenizer(w, config, tokenizer, tokenizer_cfg or {})
    for hf, t in fuse(tensors, rules_for(config)).items():
        g = gguf_name(hf, family.gguf_names)
        x = family.gguf_store(config, hf, t.detach().float())
        heads = permuted_heads(hf, config.num_attention_heads, config.num_key_value_heads)
        if family.permuted_qk and heads is not None:
            x = permute_rows(x, heads)
        kind = tensor_type(g, tuple(x.shape), qtype, config.tie_word_embeddings)
        w.add_tensor(g, quantize(x.numpy(), BY_NAME[kind].type_id), raw_dtype=_ggml(kind))
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3":
        w.add_tensor(ROPE_FREQS, _llama3_factors(config))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(out)


def _ggml(kind: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[kind]


def _metadata(w: GGUFWriter, c: ModelConfig, name: str) -> None:
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    if c.family.permuted_qk:
        w.add_rope_dimension_count(c.head_dim)
    if c.head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if c.moe is not None:
        w.add_expert_count(c.moe.num_experts)
        w.add_expert_used_count(c.moe.top_k)
        if not c.family.gguf_experts:  # a `llama` file's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(c.moe.intermediate_size)
        if c.moe.shared_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.moe.shared_intermediate_size)
        if c.moe.norm_topk_prob != c.family.gguf_norm_topk_prob:  # else the reader's default
            w.add_expert_weights_norm(c.moe.norm_topk_prob)
    s = c.rope_scaling
    if s is not None and s.rope_type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.factor)
    if s is not None and s.rope_type == "yarn":  # as llama.cpp's converter writes gpt-oss's
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
    try:
        c.family.gguf_write(w, c)
    except ValueError as e:  # a model the family's files cannot state
        raise GGUFWriteError(str(e)) from e


def _llama3_factors(c: ModelConfig) -> np.ndarray:
    """llama.cpp converter's per-frequency divisors for llama3 rope scaling."""
    s = c.rope_scaling
    freqs = 1.0 / (
        c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
    )
    low, high = (
        s.original_max_position_embeddings / f for f in (s.low_freq_factor, s.high_freq_factor)
    )
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokenizer(w: GGUFWriter, c: ModelConfig, tok: HFTokenizer, cfg: dict[str, Any]) -> None:
    model = json.loads(tok.to_str())["model"]
    if model.get("type") != "BPE":
        raise GGUFWriteError(f"only byte-level BPE tokenizers are written, got {model.get('type')}")
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    tokens, types = [], []
    for i in range(c.vocab_size):
        t = by_id.get(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        kind = TokenType.UNUSED if t is None else TokenType.NORMAL
        types.append(TokenType.CONTROL if t in special else kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for the GPT-2 split regex
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        text = cfg.get(key)
        if isinstance(text, str) and tok.token_to_id(text) is not None:
            add(tok.token_to_id(text))
    w.add_add_bos_token(False)
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])


def write_preset_gguf(
    out: str | Path,
    preset: str,
    qtype: str,
    *,
    seed: int = 0,
    config: ModelConfig | None = None,
    split_max_tensors: int = 0,
    chat_template: str | None = None,
) -> tuple[ModelConfig, list[Path]]:
    """A preset's deterministic random-weight model (`config` overrides its shape) as GGUF,
    with the preset's byte-level BPE tokenizer when it has one (`chat_template` replaces its
    template)."""
    p = get_preset(preset)
    config = config or p.config
    tok, hot = None, hot_rows(config, None)
    if p.tokenizer_vocab is not None:
        tok = build_byte_bpe(min(p.tokenizer_vocab, config.vocab_size))
        hot = hot_rows(config, word_token_ids(tok))
        ids = [tok.token_to_id(t) for t in (SPECIAL_TOKENS[0], SPECIAL_TOKENS[2])]
        config = replace(config, eos_token_ids=tuple(ids))
    tensors = random_weights(config, seed, torch.float32, hot)
    files = write_gguf(
        out,
        config,
        tensors,
        qtype=qtype,
        tokenizer=tok,
        tokenizer_cfg=None if tok is None else _with_template(tokenizer_config(), chat_template),
        split_max_tensors=split_max_tensors,
        name=preset,
    )
    return config, files


def _with_template(cfg: dict[str, Any], template: str | None) -> dict[str, Any]:
    return cfg if template is None else {**cfg, "chat_template": template}


def write_model_dir_gguf(model_dir: str | Path, out: str | Path, qtype: str) -> list[Path]:
    """An HF model directory (safetensors, tokenizer.json) as one GGUF file."""
    from tandem.loaders.safetensors_dir import ModelDir
    from tandem.loaders.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

    md = ModelDir(model_dir)
    if md.config.quant_method is not None:  # its blocks would be dequantized and requantized
        from tandem.loaders.gguf.quantized_dir import QuantizeChoiceError

        raise QuantizeChoiceError(
            f"{model_dir}: its experts are already {md.config.quant_method.upper()}; run the "
            f"directory as it is (--model {model_dir})"
        )
    tensors = {name: md.read(name) for name in md.manifest}
    if md.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tok, cfg = None, None
    if (md.path / TOKENIZER_FILE).is_file():
        tok = HFTokenizer.from_file(str(md.path / TOKENIZER_FILE))
        cfg_file = md.path / TOKENIZER_CONFIG_FILE
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    return write_gguf(
        out,
        md.config,
        tensors,
        qtype=qtype,
        tokenizer=tok,
        tokenizer_cfg=cfg,
        name=md.path.resolve().name,
    )
