"""Gemma 3 (HF `Gemma3ForCausalLM`, model_type `gemma3_text`, and the text model of
`Gemma3ForConditionalGeneration`; GGUF architecture `gemma3`) as its differences from Llama:

    block                 Gemma 3                                     ModelConfig field
    norms                 four a layer: input, post_attention,        norm_placement = "sandwich"
                          pre_feedforward, post_feedforward
                          h' = h + post_attn(attn(input(h)))
                          out = h' + post_ffn(mlp(pre_ffn(h')))
    RMSNorm               y = (1 + w) * x / rms(x), float32, rounded  norm_weight_offset = 1.0
                          once (a GGUF stores 1 + w: offset 0.0)      (GGUF: 0.0)
    q/k                   RMSNorm per head, the same (1 + w) kind     qk_norm
    MLP                   down(gelu_tanh(gate(x)) * up(x))            mlp_activation = "gelu_tanh"
    embedding             times sqrt(hidden), in the activations'     embed_scale
                          dtype
    attention scale       query_pre_attn_scalar^-1/2                  query_pre_attn_scalar
    sliding window        on the `sliding_attention` layers: 5 local  sliding_window, window_layers
                          to 1 global (`sliding_window_pattern` 6:
                          layer i is local unless (i + 1) % 6 == 0)
    rope                  local layers: base rope_local_base_freq     rope_local_theta
                          (10000), unscaled; global layers:
                          rope_theta and rope_scaling (linear 8 in
                          the 4B and larger)
    head                  tied to the embedding                       tie_word_embeddings

Refused: final or attention logit soft-capping (Gemma 2's; Gemma 3 sets neither), bidirectional
attention (EmbeddingGemma), an activation other than GELU-tanh, a local rope other than plain.

GGUF, as llama.cpp's converter writes and llama.cpp reads a `gemma3` file: norms hold 1 + w;
`attention.sliding_window` present means windowed layers by the pattern
`attention.sliding_window_pattern` (an int, or a bool per layer; 6 when absent: layer i is local
when i % 6 < 5), their rope base `rope.freq_base_swa` (10000 when absent); the attention scale is
(hidden / heads)^-1/2 for the 62-layer 27B and head_dim^-1/2 otherwise (llama.cpp derives it from
the layer count; the file has no key for it); no q/k row permutation (NEOX rope).
"""

from __future__ import annotations

from typing import Any

from tandem.config import OMIT, ConfigError, HFFields, ModelConfig, UnsupportedArchitectureError
from tandem.models.families.base import Family
from tandem.models.families.multimodal import text_weight_names

# transformers' Gemma3TextConfig defaults: what a multimodal checkpoint's `text_config` omits
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
PATTERN = 6  # transformers' and llama.cpp's sliding_window_pattern: 5 local layers, 1 global
LOCAL, GLOBAL = "sliding_attention", "full_attention"
GGUF_ARCH = "gemma3"
# model.layers.N.<HF> -> blk.N.<GGUF>, where gemma3 differs from the shared table (its `ffn_norm`
# is the norm before its MLP, not after its attention)
GGUF_NAMES: dict[str, str] = {
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
LLAMACPP_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B: its attention scale reads hidden / heads


class Gemma3VariantError(UnsupportedArchitectureError):
    """A Gemma 3 config or file with a feature tandem does not run (soft-capping,
    bidirectional attention, another activation or local rope)."""


def hf_fields(r: HFFields) -> dict[str, Any]:
    """config.json (with `HF_DEFAULTS` under it) -> the ModelConfig fields Gemma 3 sets or
    overrides (module docstring); Gemma3VariantError / ConfigError for what it cannot run."""
    d, source = r.d, r.source
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            raise Gemma3VariantError(f"{source}: Gemma 3 with {key} = {d[key]!r} is not supported")
    if d.get("use_bidirectional_attention"):
        raise Gemma3VariantError(f"{source}: bidirectional attention (EmbeddingGemma) is not run")
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise Gemma3VariantError(
            f"{source}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')"
        )
    n = d.get("num_hidden_layers")
    window = d.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{source}: Gemma 3 needs a sliding_window (a positive integer)")
    theta, scaling, local_theta = _rope(d, source)
    hidden = d.get("hidden_size")
    scalar = d.get("query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, int | float):
        raise ConfigError(f"{source}: query_pre_attn_scalar must be a number, got {scalar!r}")
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": local_theta,
        "sliding_window": window,
        "window_layers": _window_layers(d, n if isinstance(n, int) else 0, source),
        "qk_norm": True,
        "norm_placement": "sandwich",
        "norm_weight_offset": 1.0,
        "mlp_activation": "gelu_tanh",
        "embed_scale": float(hidden) ** 0.5 if isinstance(hidden, int) else None,
        "query_pre_attn_scalar": float(scalar),
    }


def _rope(d: dict[str, Any], source: str) -> tuple[Any, Any, Any]:
    """(global theta, global scaling, local theta) from `rope_parameters` per layer type
    (transformers 5) or the old `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    from tandem.config import parse_rope_scaling

    params = d.get("rope_parameters")
    if isinstance(params, dict) and (GLOBAL in params or LOCAL in params):
        full, local = params.get(GLOBAL) or {}, params.get(LOCAL) or {}
    else:
        full = dict(d.get("rope_scaling") or {})
        full["rope_theta"] = d.get("rope_theta")
        local = {"rope_theta": d.get("rope_local_base_freq")}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise ConfigError(f"{source}: 'rope_parameters' per layer type must be objects")
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise Gemma3VariantError(f"{source}: local layers' rope {local!r} is not supported")
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = None if kind == "default" else parse_rope_scaling(full, d, source)
    theta = full.get("rope_theta", HF_DEFAULTS["rope_theta"])
    local_theta = local.get("rope_theta", HF_DEFAULTS["rope_local_base_freq"])
    for name, v in (("rope_theta", theta), ("rope_local_base_freq", local_theta)):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{source}: field {name!r} must be a number, got {v!r}")
    return float(theta), scaling, float(local_theta)


def _window_layers(d: dict[str, Any], n: int, source: str) -> tuple[int, ...]:
    """The local layers: `layer_types` as stated, else every layer but each PATTERN-th."""
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern", PATTERN)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{source}: sliding_window_pattern must be a positive integer")
        return tuple(i for i in range(n) if (i + 1) % pattern)
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in (LOCAL, GLOBAL) for t in types)
    ):
        raise ConfigError(f"{source}: 'layer_types' must list {n} of '{LOCAL}' / '{GLOBAL}'")
    return tuple(i for i, t in enumerate(types) if t == LOCAL)


def _whole(v: float) -> float | int:
    """An integral value as an int (transformers' config declares the scalar an int)."""
    return int(v) if float(v).is_integer() else v


def hf_extras(c: ModelConfig) -> dict[str, Any]:
    """What makes the shared config.json fields Gemma 3's (old rope layout, which transformers
    4.50 and 5 both read)."""
    return dict(
        hidden_act=OMIT,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=_whole(c.query_pre_attn_scalar or c.head_dim),
        sliding_window=c.sliding_window,
        layer_types=[GLOBAL if c.window(i) is None else LOCAL for i in range(c.num_hidden_layers)],
        rope_local_base_freq=c.rope_local_theta,
        attention_bias=c.o_bias,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )


# ---- GGUF ------------------------------------------------------------------------------------


def gguf_fields(g: Any) -> dict[str, Any]:
    """A `gemma3` file's metadata (`loaders.gguf.config.GGUFFields`: `meta`, keys under prefix
    `a`, e.g. "gemma3.") -> the ModelConfig fields Gemma 3 sets or overrides (module docstring)."""
    meta, a = g.meta, g.a
    if meta.get(a + "final_logit_softcapping", float, 0.0):
        raise Gemma3VariantError(f"{meta.file}: final logit soft-capping is not supported")
    if meta.get(a + "attn_logit_softcapping", float, 0.0):
        raise Gemma3VariantError(f"{meta.file}: attention logit soft-capping is not supported")
    layers = meta.get(a + "block_count", int)
    hidden = meta.get(a + "embedding_length", int)
    heads = meta.get(a + "attention.head_count", int)
    window = meta.get(a + "attention.sliding_window", int, 0)
    local: dict[str, Any] = {"sliding_window": None, "window_layers": None}
    if window > 0:
        local = {
            "sliding_window": window,
            "window_layers": _gguf_window_layers(
                meta, a + "attention.sliding_window_pattern", layers
            ),
            "rope_local_theta": meta.get(a + "rope.freq_base_swa", float, 10_000.0),
        }
    scalar = None  # head_dim
    if layers == LLAMACPP_27B_LAYERS and heads:
        scalar = float(hidden // heads)
    return {
        **local,
        "qk_norm": True,
        "norm_placement": "sandwich",
        "norm_weight_offset": 0.0,
        "mlp_activation": "gelu_tanh",
        "embed_scale": float(hidden) ** 0.5,
        "query_pre_attn_scalar": scalar,
    }


def _gguf_window_layers(meta: Any, key: str, layers: int) -> tuple[int, ...]:
    """llama.cpp's `load_swa_pattern(ml, 6)`: a bool per layer, or n (layer i local when
    i % n < n - 1; n = 0 makes every layer local)."""
    count = meta.count(key)
    if count is not None and count > 1:
        flags = meta.get(key, list)
        if len(flags) != layers:
            raise ConfigError(f"{meta.file}: {key} has {len(flags)} values for {layers} layers")
        return tuple(i for i, f in enumerate(flags) if f)
    n = meta.get(key, int, PATTERN)
    return tuple(i for i in range(layers) if n == 0 or i % n < n - 1)


def gguf_write(w: Any, c: ModelConfig) -> None:
    """The `gemma3.*` keys a file of `c` carries beyond the shared ones, as llama.cpp's converter
    writes them, to gguf-py writer `w`; ValueError for a `c` the file cannot state."""
    for key, (kind, value) in gguf_kv(c).items():
        getattr(w, f"add_{kind}")(f"{GGUF_ARCH}.{key}", value)


def gguf_kv(c: ModelConfig) -> dict[str, tuple[str, Any]]:
    """The `gemma3.*` keys (suffix -> (gguf-py add_ method's type, value)) a file of `c` carries
    beyond the shared ones (the key and value lengths always: transformers' reader needs them;
    the shared writer states them only when they differ from hidden / heads); ValueError for a `c`
    the file cannot state (an attention scale llama.cpp would not derive)."""
    kv: dict[str, tuple[str, Any]] = {}
    if c.head_dim == c.hidden_size // c.num_attention_heads:
        kv["attention.key_length"] = ("uint32", c.head_dim)
        kv["attention.value_length"] = ("uint32", c.head_dim)
    if c.sliding_window is not None:
        kv["attention.sliding_window"] = ("uint32", c.sliding_window)
        default = tuple(i for i in range(c.num_hidden_layers) if i % PATTERN < PATTERN - 1)
        if tuple(c.window_layers or range(c.num_hidden_layers)) != default:
            flags = [c.window(i) is not None for i in range(c.num_hidden_layers)]
            kv["attention.sliding_window_pattern"] = ("array", flags)
        if c.rope_local_theta not in (None, 10_000.0):
            kv["rope.freq_base_swa"] = ("float32", c.rope_local_theta)
    derived = None
    if c.num_hidden_layers == LLAMACPP_27B_LAYERS:
        derived = float(c.hidden_size // c.num_attention_heads)
    if (c.query_pre_attn_scalar or c.head_dim) != (derived or c.head_dim):
        raise ValueError(
            f"query_pre_attn_scalar {c.query_pre_attn_scalar} is not what llama.cpp derives for "
            f"{c.num_hidden_layers} layers ({derived or c.head_dim}); a gemma3 GGUF cannot state it"
        )
    return kv


def gguf_store(c: ModelConfig, hf_name: str, x: Any) -> Any:
    """Tensor `hf_name` as llama.cpp's converter stores it: every norm weight of an HF checkpoint
    plus its offset (the GGUF holds 1 + w)."""
    return x + (c.norm_weight_offset or 0.0) if hf_name.endswith("norm.weight") else x


FAMILY = Family(
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    multimodal=("Gemma3ForConditionalGeneration",),
    hf_defaults=HF_DEFAULTS,
    own_activation=True,
    hf_fields=hf_fields,
    hf_extras=hf_extras,
    gguf_arch=GGUF_ARCH,
    gguf_fields=gguf_fields,
    gguf_write=gguf_write,
    gguf_names=GGUF_NAMES,
    gguf_store=gguf_store,
    checkpoint_renames=text_weight_names,
)
