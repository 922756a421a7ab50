"""Phi-3 / Phi-4-mini (HF `Phi3ForCausalLM`, model_type `phi3`; GGUF architecture `phi3`): the
Llama decoder with these differences, each stated here and nowhere else (torch-free):

    checkpoint     q, k, v as one `self_attn.qkv_proj` (H hd + 2 Hkv hd, D): rows [0, H hd) q,
                   then Hkv hd of k, then Hkv hd of v; gate, up as one `mlp.gate_up_proj` (2I, D):
                   rows [0, I) gate, [I, 2I) up. GGUF: `attn_qkv` and `ffn_up` (llama.cpp's
                   converter keeps both fused; a phi3 file's `ffn_up` is gate and up).
                   `FUSED_ROWS` splits them into the reference's projections by rows, so a
                   tensor-parallel rank reads only its rows of q, k, v, gate and up.
    RoPE           `partial_rotary_factor` f: only the first rotary_dim = int(hd f) dims of each
                   head rotate (rotate-half within them), the rest pass through (GGUF:
                   `rope.dimension_count` = rotary_dim).
    longrope       inv_freq_i = 1 / (factor_i * theta^(2i / rotary_dim)), the `short_factor`
                   set while a sequence holds at most `original_max_position_embeddings` tokens,
                   the `long_factor` set past it (for all of its positions, as transformers
                   recomputes them); cos and sin scaled by the attention factor: as stated, else
                   sqrt(1 + ln(s) / ln(original)) with s = factor or max_position_embeddings /
                   original (1 when s <= 1). GGUF: tensors `rope_factors_short/long.weight`,
                   `rope.scaling.attn_factor`, `rope.scaling.original_context_length`.
    window         `sliding_window` on every layer when the config states one (transformers'
                   mask: a query at p sees keys at p - W < k <= p); GGUF
                   `attention.sliding_window` (0: none).
    no biases      attention and MLP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tandem.models.families.base import Family

ARCHITECTURE = "Phi3ForCausalLM"
GGUF_ARCH = "phi3"
ROPE_TYPES = ("default", "longrope")  # HF's legacy "su" and "yarn" for Phi-3 mean longrope
DEFAULT_ORIGINAL_LENGTH = 4096  # Phi3Config's original_max_position_embeddings
GGUF_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # blk.N.<x> -> HF
GGUF_ROPE_FACTORS = {"short_factor": "rope_factors_short.weight",
                     "long_factor": "rope_factors_long.weight"}  # fmt: skip


def fused_rows(config) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each fused checkpoint projection (relative to `model.layers.<i>.`) -> its parts in row
    order, (reference projection, rows)."""
    H, Hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter = config.intermediate_size
    return {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", H * hd),
            ("self_attn.k_proj", Hkv * hd),
            ("self_attn.v_proj", Hkv * hd),
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", inter), ("mlp.up_proj", inter)),
    }


def longrope_attention_factor(factor: float, original: int) -> float:
    """transformers' `_compute_longrope_parameters` default: sqrt(1 + ln s / ln original)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def hf_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields a Phi-3 `config.json` sets beyond the common ones (module
    docstring); ConfigError naming a rope type tandem does not run."""
    from tandem.config import ConfigError, RopeScaling, _typed

    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or rope
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: 'rope_scaling' / 'rope_parameters' must be objects")
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    fields: dict[str, Any] = {
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
        "partial_rotary_factor": _typed(partial, float, "partial_rotary_factor", source),
        "sliding_window": None,
        "rope_scaling": None,
    }
    window = d.get("sliding_window")
    if window is not None:
        fields["sliding_window"] = _typed(window, int, "sliding_window", source)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("su", "yarn"):
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: Phi-3 rope_type {kind!r} is not supported; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return fields
    orig = scaling.get("original_max_position_embeddings")
    orig = (
        d.get("original_max_position_embeddings", DEFAULT_ORIGINAL_LENGTH) if orig is None else orig
    )
    orig = _typed(orig, int, "original_max_position_embeddings", source)
    lists = {}
    for name in ("short_factor", "long_factor"):
        v = scaling.get(name)
        if not isinstance(v, list):
            raise ConfigError(f"{source}: longrope field {name!r} must be a list of numbers")
        lists[name] = tuple(_typed(x, float, f"rope_scaling.{name}", source) for x in v)
    att = scaling.get("attention_factor")
    if att is None:
        factor = scaling.get("factor")
        if factor is None:
            factor = (
                _typed(
                    d.get("max_position_embeddings", 4096), int, "max_position_embeddings", source
                )
                / orig
            )
        att = longrope_attention_factor(_typed(factor, float, "rope_scaling.factor", source), orig)
    fields["rope_scaling"] = RopeScaling(
        "longrope",
        1.0,
        original_max_position_embeddings=orig,
        attention_factor=_typed(att, float, "rope_scaling.attention_factor", source),
        **lists,
    )
    return fields


def hf_dict(config) -> dict[str, Any]:
    """The config.json fields transformers' Phi3Config reads for `config` (inverse of
    `hf_fields`)."""
    s = config.rope_scaling
    orig = s.original_max_position_embeddings if s is not None else config.max_position_embeddings
    return {
        "partial_rotary_factor": config.partial_rotary_factor,
        "original_max_position_embeddings": orig,
        "sliding_window": config.sliding_window,
    }


Get = Callable[..., Any]  # Metadata.get(key, kind, default)


def _gguf_write(w: Any, c: Any) -> None:
    """What llama.cpp's Phi3MiniModel writes beyond the shared keys: the rotary width, the
    original context, the window (0: none), longrope's attention factor and factor tensors."""
    import numpy as np

    s = c.rope_scaling
    w.add_rope_dimension_count(c.rotary_dim)
    orig = s.original_max_position_embeddings if s is not None else c.max_position_embeddings
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_sliding_window(c.sliding_window or 0)
    if s is not None and s.rope_type == "longrope":
        w.add_rope_scaling_attn_factors(s.attention_factor)
        for field in ("long_factor", "short_factor"):  # the converter's order
            w.add_tensor(GGUF_ROPE_FACTORS[field], np.array(getattr(s, field), dtype=np.float32))


def gguf_fields(
    get: Get, prefix: str, head_dim: int, context: int, factors: dict[str, list[float]]
) -> dict[str, Any]:
    """The ModelConfig fields a `phi3` GGUF sets beyond the common ones: partial rotary from
    `rope.dimension_count`, longrope from the `rope_factors_*` tensors' values (`factors`, keyed
    short_factor / long_factor), the window from `attention.sliding_window`."""
    from tandem.config import RopeScaling

    rotary = get(prefix + "rope.dimension_count", int, head_dim)
    partial = rotary / head_dim if head_dim else 1.0
    while head_dim and int(head_dim * partial) < rotary:  # int() must give rotary back
        partial = math.nextafter(partial, 2.0)
    window = get(prefix + "attention.sliding_window", int, 0)
    fields: dict[str, Any] = {
        "partial_rotary_factor": min(partial, 1.0),
        "sliding_window": window or None,
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
    }
    if factors:
        orig = get(prefix + "rope.scaling.original_context_length", int, context)
        att = get(prefix + "rope.scaling.attn_factor", float, None)
        if att is None:
            att = longrope_attention_factor(context / orig, orig)
        fields["rope_scaling"] = RopeScaling(
            "longrope",
            1.0,
            original_max_position_embeddings=orig,
            attention_factor=att,
            short_factor=tuple(factors.get("short_factor", ())),
            long_factor=tuple(factors.get("long_factor", ())),
        )
    return fields


FAMILY = Family(
    architecture=ARCHITECTURE,
    model_type="phi3",
    own_rope=True,
    hf_fields=lambda r: hf_fields(r.d, r.source),
    hf_extras=hf_dict,
    gguf_arch=GGUF_ARCH,
    gguf_fields=lambda g: gguf_fields(
        g.meta.get, g.a, g.head_dim, g.meta.get(g.a + "context_length", int), g.values
    ),
    gguf_write=_gguf_write,
    gguf_names={hf: gguf for gguf, hf in GGUF_FUSED.items()},
    gguf_partial_rotary=True,
    gguf_config_tensors=GGUF_ROPE_FACTORS,
    fused_rows=fused_rows,
)
