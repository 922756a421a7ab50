"""GGUF metadata -> `ModelConfig`, for the architectures tandem runs.

    GGUF key ({arch}.)                   ModelConfig field
    embedding_length                     hidden_size
    feed_forward_length                  intermediate_size (absent where every layer is sparse,
                                         as llama.cpp's converter writes qwen35moe: the experts')
    block_count                          num_hidden_layers
    attention.head_count / head_count_kv num_attention_heads / num_key_value_heads
    attention.key_length                 head_dim (else rope.dimension_count, else hidden / heads)
    attention.layer_norm_rms_epsilon     rms_norm_eps
    context_length                       max_position_embeddings
    rope.freq_base                       rope_theta (default 10000)
    rope.scaling.type/factor             rope_scaling ("linear"; "none" is plain RoPE)
    tensor rope_freqs (llama3 scaling)   rope_freq_factors
    vocab_size                           vocab_size (else the tokenizer's token count)
    tokenizer.ggml.bos/eos/eot/eom_token_id   bos_token_id / eos_token_ids
    no `output.weight` tensor            tie_word_embeddings
    attn_q / attn_output / ffn_gate .bias present   qkv_bias / o_bias / mlp_bias (qwen2: qkv always)
    qwen3, qwen3moe                      qk_norm
    expert_count / expert_used_count     moe.num_experts / moe.top_k (a mixture of experts:
                                         `qwen3moe`, `qwen2moe`, or `llama` with `ffn_*_exps`
                                         tensors = Mixtral)
    expert_feed_forward_length           moe.intermediate_size (Mixtral: feed_forward_length)
    expert_weights_norm                  moe.norm_topk_prob (default true, as llama.cpp runs
                                         qwen3moe and Mixtral; false for qwen2moe, as it runs that)
    expert_shared_feed_forward_length    moe.shared_intermediate_size (qwen2moe's ffn_*_shexp and
                                         their sigmoid gate ffn_gate_inp_shexp)
    a layer without ffn_gate_exps        a dense layer among the sparse ones
    gpt-oss                              attn_sinks; attention.sliding_window on the even layers
                                         (llama.cpp's pattern); rope.scaling.type yarn with
                                         .factor, .original_context_length, .yarn_beta_fast/slow
                                         (truncated corrections, as llama.cpp and transformers
                                         read a file); the router (top-k then softmax, biased),
                                         the experts' biases and clamped SwiGLU (alpha 1.702,
                                         limit 7: llama.cpp's constants)
    phi3                                 `models.families.phi3`: fused attn_qkv / ffn_up (gate,
                                         up) split by rows; rope.dimension_count < head_dim:
                                         partial rotary; rope_factors_short/long tensors:
                                         longrope (rope.scaling.attn_factor,
                                         .original_context_length); attention.sliding_window

    gemma3                               `models.families.gemma3.gguf_fields`: sandwich norms
                                         stored as 1 + w, GELU-tanh, the embedding scale, the
                                         sliding window and its layer pattern, the local rope
                                         base, llama.cpp's attention scale

`llama` covers Llama, Mistral and SmolLM files (llama.cpp writes them all as `llama`, q/k rows
permuted; see `names`); `qwen2` and `qwen3` are stored unpermuted.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from tandem.config import (
    ConfigError,
    ModelConfig,
    RopeScaling,
    UnsupportedArchitectureError,
    yarn_attention_factor,
)
from tandem.loaders.gguf.reader import GGUFError, GuardedReader
from tandem.models import families
from tandem.models.families.base import Family
from tandem.moe_config import MoESpec

_MISSING = object()


class GGUFArchitectureError(GGUFError, UnsupportedArchitectureError):
    """A GGUF file of an architecture (or variant) tandem does not run."""


class GGUFMetadataError(GGUFError, ConfigError):
    """A metadata value that is missing, of the wrong type, or one tandem cannot run."""


class Metadata:
    """Typed access to a GGUF file's key/value metadata (`ReaderField.contents()`)."""

    def __init__(self, reader: GuardedReader, file: Path) -> None:
        self.fields = reader.fields
        self.file = file

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """The value of `key` as `kind` (int, float, str, bool or list); `default` when absent,
        GGUFMetadataError when absent without a default or of another type."""
        field = self.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFMetadataError(f"{self.file}: metadata key {key!r} is missing")
            return default
        try:
            value = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise GGUFMetadataError(f"{self.file}: metadata key {key!r} is unreadable ({e})") from e
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            str: isinstance(value, str),
            bool: isinstance(value, bool),
            list: isinstance(value, list),
        }[kind]
        if not ok:
            raise GGUFMetadataError(
                f"{self.file}: metadata key {key!r} must be {kind.__name__}, got {value!r:.80}"
            )
        return float(value) if kind is float else value

    def count(self, key: str) -> int | None:
        """Elements of array `key` without materializing them, or None when absent."""
        field = self.fields.get(key)
        return None if field is None else len(field.data)


def architecture(meta: Metadata) -> str:
    arch = meta.get("general.architecture", str)
    if arch not in families.GGUF_ARCHITECTURES:
        raise GGUFArchitectureError(
            f"{meta.file}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(families.GGUF_ARCHITECTURES)}"
        )
    return arch


def family_of(meta: Metadata, tensors: Collection[str]) -> Family:
    """The family `meta`'s file is read as (`families.by_gguf`: a `llama` file with experts is
    Mixtral)."""
    experts = any(n.endswith("ffn_gate_exps.weight") for n in tensors)
    return families.by_gguf(architecture(meta), experts)


class GGUFFields:
    """What a family's `gguf_fields` reads: `meta`, the key prefix `a` ("{arch}."), the tensor
    names present, the layer count, the head width and its `gguf_config_tensors`' values."""

    def __init__(
        self,
        meta: Metadata,
        a: str,
        tensors: Collection[str],
        layers: int,
        head_dim: int,
        values: Mapping[str, list[float]],
    ) -> None:
        self.meta, self.a, self.tensors, self.layers = meta, a, tensors, layers
        self.head_dim, self.values = head_dim, values


def config_from_gguf(
    meta: Metadata,
    tensors: Collection[str],
    embed_rows: int | None,
    rope_freqs: Sequence[float] | None,
    values: Mapping[str, list[float]] | None = None,
) -> ModelConfig:
    """The model's config from `meta`, the GGUF tensor names present, the token embedding's row
    count (the vocabulary when the metadata states none), the `rope_freqs` values if any and the
    values of the family's `gguf_config_tensors` present (by field)."""
    family = family_of(meta, tensors)
    a = f"{family.gguf_arch}."
    hidden = meta.get(a + "embedding_length", int)
    heads = meta.get(a + "attention.head_count", int)
    kv = _per_layer(meta, a + "attention.head_count_kv", heads)
    rope_dims = meta.get(a + "rope.dimension_count", int, None)
    if family.gguf_partial_rotary:  # the rotary width, read by the family's gguf_fields
        rope_dims = None
    head_dim = meta.get(
        a + "attention.key_length", int, rope_dims or (hidden // heads if heads else 0)
    )
    value_dim = meta.get(a + "attention.value_length", int, head_dim)
    if value_dim != head_dim or (rope_dims is not None and rope_dims != head_dim):
        raise GGUFArchitectureError(
            f"{meta.file}: key length {head_dim}, value length {value_dim}, rope dimensions "
            f"{rope_dims}: tandem runs only full-width RoPE with equal key and value heads"
        )
    vocab = (
        meta.get(a + "vocab_size", int, None) or meta.count("tokenizer.ggml.tokens") or embed_rows
    )
    if not vocab:
        raise GGUFMetadataError(f"{meta.file}: no vocabulary size (vocab_size, tokens, token_embd)")
    eos = []
    for key in ("eos", "eot", "eom"):
        t = meta.get(f"tokenizer.ggml.{key}_token_id", int, None)
        if t is not None and t not in eos:
            eos.append(t)
    layers = _layers(meta, a, tensors)
    try:
        moe = _moe(meta, a, tensors, family.gguf_norm_topk_prob)
        ffn = meta.get(a + "feed_forward_length", int, None)
        if ffn is None and moe is not None and not moe.dense_layers:
            ffn = (
                moe.intermediate_size
            )  # every layer sparse: no dense width (qwen35moe's converter)
        fields: dict[str, Any] = dict(
            architecture=family.architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ffn or meta.get(a + "feed_forward_length", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            max_position_embeddings=meta.get(a + "context_length", int),
            rms_norm_eps=meta.get(a + "attention.layer_norm_rms_epsilon", float),
            rope_theta=meta.get(a + "rope.freq_base", float, 10000.0),
            rope_scaling=_rope_scaling(meta, a),
            rope_freq_factors=tuple(float(f) for f in rope_freqs)
            if rope_freqs is not None
            else None,
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_gate.bias" in tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id", int, None),
            eos_token_ids=tuple(eos),
            torch_dtype="float32",
            moe=moe,
        )
        got = GGUFFields(meta, a, tensors, layers, head_dim, values or {})
        fields.update(family.gguf_fields(got))
        cfg = ModelConfig(**fields)
        cfg.validate(str(meta.file))
    except GGUFError:
        raise
    except UnsupportedArchitectureError as e:  # a family's refusal of a variant (gemma3)
        raise GGUFArchitectureError(str(e)) from e
    except ConfigError as e:
        raise GGUFMetadataError(str(e)) from e
    if rope_freqs is not None and len(rope_freqs) != head_dim // 2:
        raise GGUFMetadataError(
            f"{meta.file}: tensor 'rope_freqs.weight' has {len(rope_freqs)} values, head_dim "
            f"{head_dim} implies {head_dim // 2}"
        )
    return cfg


def _moe(meta: Metadata, a: str, tensors: Collection[str], norm: bool) -> MoESpec | None:
    """The experts a file's metadata and tensors describe, or None for a dense model; the top k
    renormalised per `expert_weights_norm`, else `norm` (the family's reading)."""
    n = meta.get(a + "expert_count", int, 0)
    if not n:
        return None
    layers = meta.get(a + "block_count", int)
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensors)
    width = meta.get(a + "expert_feed_forward_length", int, None)
    experts = dict(
        num_experts=n,
        top_k=meta.get(a + "expert_used_count", int),
        intermediate_size=width or meta.get(a + "feed_forward_length", int),
    )
    return MoESpec(
        **experts,
        norm_topk_prob=meta.get(a + "expert_weights_norm", bool, norm),
        dense_layers=dense,
        shared_intermediate_size=meta.get(a + "expert_shared_feed_forward_length", int, 0),
    )


def _layers(meta: Metadata, a: str, tensors: Collection[str]) -> int:
    n = meta.get(a + "block_count", int)
    if not 0 < n <= len(tensors):  # every layer holds tensors: a larger count is a lie
        raise GGUFMetadataError(
            f"{meta.file}: block_count {n} but the file holds {len(tensors)} tensors"
        )
    return n


def _per_layer(meta: Metadata, key: str, default: int) -> int:
    """A count llama.cpp may store per layer (an array): tandem needs it uniform."""
    field = meta.fields.get(key)
    if field is not None and len(field.data) > 1:
        values = set(meta.get(key, list))
        if len(values) != 1:
            raise GGUFArchitectureError(
                f"{meta.file}: {key} differs between layers ({sorted(values)}); tandem runs "
                "uniform layers only"
            )
        return int(values.pop())
    return meta.get(key, int, default)


def _rope_scaling(meta: Metadata, a: str) -> RopeScaling | None:
    kind = meta.get(a + "rope.scaling.type", str, "none")
    if kind == "none":
        return None
    factor = meta.get(a + "rope.scaling.factor", float, 1.0)
    if kind == "linear":
        return None if factor == 1.0 else RopeScaling("linear", factor)
    if kind == "yarn":
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=meta.get(
                a + "rope.scaling.original_context_length", int
            ),
            beta_fast=meta.get(a + "rope.scaling.yarn_beta_fast", float, 32.0),
            beta_slow=meta.get(a + "rope.scaling.yarn_beta_slow", float, 1.0),
            truncate=True,
            attention_factor=yarn_attention_factor(factor),
        )
    raise GGUFArchitectureError(
        f"{meta.file}: rope scaling {kind!r} is not supported (none, linear, yarn, or llama3 "
        "frequency factors)"
    )
