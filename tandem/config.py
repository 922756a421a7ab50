"""Frozen configuration records shared by every package.

`ModelConfig` is the model's shape as Hugging Face `config.json` states it (field names kept as HF
spells them), normalised across the supported architectures: the shape every family shares is read
here, and each family (`tandem.models.families`, one declaration each) sets its own switches: biases,
q/k norms, sliding windows, attention sinks, a `MoESpec` (`tandem.moe_config`), Gemma's sandwich
norms, `(offset + w)` RMSNorm, GELU-tanh MLP, embedding and attention scales and local rope base,
Phi-3's partial rotary and `longrope`, Qwen3.5's Gated DeltaNet layers (`tandem.deltanet_config`)
and gated attention.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem import boundedjson
from tandem.deltanet_config import DeltaNetSpec
from tandem.moe_config import MoESpec, moe_checkpoint_names

if TYPE_CHECKING:
    from tandem.models.families.base import Family

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")  # longrope: Phi-3 only
NORM_PLACEMENTS = ("pre", "sandwich")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
CONFIG_MAX_BYTES = 4 << 20  # config.json files are a few KB; id2label tables stay far below this
CONFIG_MAX_DEPTH = 32


OMIT = object()  # a family's `hf_extras` value: leave this key out of config.json


class ConfigError(ValueError):
    """A config.json that is unreadable, lacks a required field, or holds a value we cannot run."""


class UnsupportedArchitectureError(ConfigError):
    """The config names an architecture tandem does not implement."""


class ConfigFieldError(ConfigError):
    """A field outside the range tandem can run; names the field, the value and the range."""

    def __init__(self, name: str, value: Any, allowed: str, source: str = "model config") -> None:
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"{source}: {name} = {value!r} is outside the allowed range: {allowed}")

    def at(self, source: str) -> ConfigFieldError:
        return type(self)(self.name, self.value, self.allowed, source)


class UnsupportedQuantizationError(ConfigFieldError):
    """config.json's `quantization_config` names a method tandem does not read for the model's
    architecture (`Family.quant_methods`)."""


# Every size a config may state, inclusive, checked before anything is built or allocated: wide
# enough for any published model (the largest have ~128 layers, 16k hidden, 256k vocabulary), far
# short of what would exhaust memory just building the model's skeleton.
INT_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 25),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position_embeddings": (1, 1 << 24),
}
# finite floats, inclusive: eps 0 or NaN and theta 0 give NaN or empty output, not an error
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (1e-12, 1.0),
    "rope_theta": (1.0, 1e12),
    "rope_scaling.factor": (1.0, 1024.0),
    "rope_scaling.low_freq_factor": (1e-6, 1024.0),
    "rope_scaling.high_freq_factor": (1e-6, 1024.0),
    "rope_scaling.beta_fast": (1e-6, 1e6),
    "rope_scaling.beta_slow": (1e-6, 1e6),
    "rope_scaling.attention_factor": (1e-6, 1e6),
    "rope_local_theta": (1.0, 1e12),
    "norm_weight_offset": (-1.0, 1.0),
    "embed_scale": (1e-6, 1e6),
    "query_pre_attn_scalar": (1e-6, 1e12),
    "rope_scaling.short_factor": (1e-6, 1e6),  # each element of longrope's factor lists
    "rope_scaling.long_factor": (1e-6, 1e6),
    "partial_rotary_factor": (1e-6, 1.0),
}
TOKEN_ID_MAX = (1 << 31) - 1
# a Gated DeltaNet layer's tensors, relative to `model.layers.<i>.linear_attn.` (`models.deltanet`)
LINEAR_ATTN_TENSORS = (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight",
)  # fmt: skip
MAX_EOS_IDS = 64


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling: `llama3` (Llama 3.1+: factor, the two freq factors, the original length),
    `linear` (positions divided by `factor`; the other fields unused), `yarn` (gpt-oss: factor,
    beta_fast/beta_slow, truncate, the original length, and the `attention_factor` cos and sin are
    multiplied by: 0.1 ln(factor) + 1 unless the config states it) or `longrope` (Phi-3: per
    frequency divisors `short_factor` / `long_factor`, the long set for a sequence longer than the
    original length, and the `attention_factor`; `factor` unused); absent for plain RoPE."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def to_hf_dict(self) -> dict[str, Any]:
        if self.rope_type == "longrope":
            return {
                "rope_type": "longrope",
                "short_factor": list(self.short_factor),
                "long_factor": list(self.long_factor),
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor,
            }
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "yarn":
            keys = ("factor", "beta_fast", "beta_slow", "truncate", "attention_factor")
            d = {k: getattr(self, k) for k in keys}
            return {
                "rope_type": "yarn",
                **d,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        d = asdict(self)
        for k in ("beta_fast", "beta_slow", "truncate", "attention_factor"):
            del d[k]
        for k in ("short_factor", "long_factor"):
            del d[k]
        return d


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_bias: bool = False  # Llama when attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys
    # the layers the sliding window applies to (gpt-oss: every other one); None: all of them
    window_layers: tuple[int, ...] | None = None
    attn_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax (`sinks`)
    # llama.cpp's per-frequency divisors (a GGUF's `rope_freqs` tensor, how its converter stores
    # llama3 scaling): inv_freq[i] / rope_freq_factors[i]; HF config.json has no such field
    rope_freq_factors: tuple[float, ...] | None = None
    # Phi-4-mini: RoPE rotates only the first `rotary_dim` = int(head_dim * factor) dims of a head
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"
    moe: MoESpec | None = None  # a mixture-of-experts model: its sparse layers (`moe_config`)
    # "pre": h + f(norm(h)) per block; "sandwich" (Gemma): h + norm_post(f(norm_pre(h))), four
    # norms a layer (`models.sandwich.SandwichDecoderLayer`)
    norm_placement: str = "pre"
    # None: Llama's RMSNorm, y = w * x / rms(x) in the activations' dtype; a number: Gemma's,
    # y = (offset + w) * x / rms(x) in float32, rounded once (HF stores w: offset 1; llama.cpp's
    # converter stores 1 + w: offset 0)
    norm_weight_offset: float | None = None
    mlp_activation: str = "silu"  # the gated MLP's act(gate) * up: "silu", "gelu_tanh" (Gemma)
    embed_scale: float | None = None  # embeddings times this, in their dtype (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # logits scaled by its -1/2 power (None: head_dim)
    # the windowed layers' rope base, unscaled (Gemma 3's local layers); None: rope_theta and
    # rope_scaling on every layer
    rope_local_theta: float | None = None
    # config.json's quantization_config.quant_method: how the checkpoint stores some weights
    # (gpt-oss's "mxfp4": its experts as MXFP4 blocks, `loaders.mxfp4_dir`); None: as floats
    quant_method: str | None = None
    # Qwen3.5: the Gated DeltaNet layers and their shape (`deltanet_config`); the other layers'
    # attention has a sigmoid output gate (`attn_output_gate`: q_proj holds each head's query
    # and gate rows, `models.qwen35`)
    deltanet: DeltaNetSpec | None = None
    attn_output_gate: bool = False

    def window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (None: every earlier key)."""
        if self.sliding_window is None:
            return None
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` holds the MoE block (else the dense MLP of `intermediate_size`)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` mixes tokens with a Gated DeltaNet (no KV cache) rather than
        attention."""
        return self.deltanet is not None and layer in self.deltanet.linear_layers

    @property
    def hybrid(self) -> bool:
        """A model with recurrent (DeltaNet) layers: a sequence's state cannot be rewound."""
        return self.deltanet is not None and bool(self.deltanet.linear_layers)

    def rope_local(self, layer: int) -> bool:
        """Whether layer `layer` rotates with `rope_local_theta` (a windowed layer of a model
        that states one) rather than `rope_theta` and `rope_scaling`."""
        return self.rope_local_theta is not None and self.window(layer) is not None

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax: query_pre_attn_scalar^-1/2, else
        head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def family(self) -> Family:
        """This architecture's declaration (`tandem.models.families`)."""
        from tandem.models import families

        return families.by_architecture(self.architecture)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates (transformers' int(hd * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def checkpoint_names(self) -> frozenset[str]:
        """The HF names of every tensor a checkpoint of this model holds (a tied head reads the
        embedding: no `lm_head.weight`); the reference model's parameters map onto exactly these
        (`Transformer.checkpoint_name`, tests/unit/test_config.py)."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        for p in ("q", "k", "v", "o"):
            per_layer.append(f"self_attn.{p}_proj.weight")
            if self.o_bias if p == "o" else self.qkv_bias:
                per_layer.append(f"self_attn.{p}_proj.bias")
        dense = []
        for p in ("gate", "up", "down"):
            dense.append(f"mlp.{p}_proj.weight")
            if self.mlp_bias:
                dense.append(f"mlp.{p}_proj.bias")
        if self.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if self.attn_sinks:
            per_layer.append("self_attn.sinks")
        if self.norm_placement == "sandwich":
            per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
        norms = per_layer[:2]
        linear = [f"linear_attn.{n}" for n in LINEAR_ATTN_TENSORS]
        for i in range(self.num_hidden_layers):
            ffn = moe_checkpoint_names(self.moe) if self.is_sparse(i) else dense
            mixer = norms + linear if self.is_linear(i) else per_layer
            names.update(f"model.layers.{i}.{n}" for n in mixer + ffn)
        return frozenset(names)

    # ---- parsing -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            text = file.read_text()
        except OSError as e:
            raise ConfigError(f"{file}: cannot read config ({e.strerror or e})") from e
        try:
            d = boundedjson.loads(text, max_bytes=CONFIG_MAX_BYTES, max_depth=CONFIG_MAX_DEPTH)
        except boundedjson.BoundedJSONError as e:
            raise ConfigError(f"{file}: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{file}: expected a JSON object at top level")
        return cls.from_hf_dict(d, source=str(file))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parses an HF `config.json` dict: the shape every family shares here, then the family's
        own fields (`Family.hf_fields`). Old (`rope_theta`/`rope_scaling`) and new
        (`rope_parameters`) rope layouts are both accepted."""
        from tandem.models import families

        archs = d.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        family = (
            families.by_architecture(arch) if arch else families.by_model_type(d.get("model_type"))
        )
        if family is None:
            raise UnsupportedArchitectureError(
                f"{source}: architecture {arch or d.get('model_type')!r} is not supported; "
                f"supported: {', '.join(families.supported_architectures())}"
            )
        if arch in family.multimodal:  # a multimodal checkpoint: its text model's config
            d = _text_config(d, source)
        d = {**family.hf_defaults, **d}  # transformers' defaults for what the config omits
        r = HFFields(d, source)
        hidden = r.need("hidden_size")
        n_heads = r.need("num_attention_heads")
        act = d.get("hidden_act", "silu")
        if act != "silu" and not family.own_activation:
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: 'rope_parameters' must be an object")
        theta = rope.get("rope_theta", d.get("rope_theta", family.rope_theta))
        scaling_d = d.get("rope_scaling") or rope
        if isinstance(scaling_d, dict) and scaling_d.get("rope_type", scaling_d.get("type")) in (
            None,
            "default",
        ):
            scaling_d = None
        attn_bias = bool(d.get("attention_bias", family.attention_bias))
        eos = d.get("eos_token_id")
        bos = d.get("bos_token_id")
        fields: dict[str, Any] = dict(
            architecture=family.architecture,
            vocab_size=r.need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.need("intermediate_size"),
            num_hidden_layers=r.need("num_hidden_layers"),
            num_attention_heads=n_heads,
            num_key_value_heads=r.opt("num_key_value_heads", int, n_heads),
            head_dim=r.opt("head_dim", int, hidden // n_heads if n_heads else 0),
            max_position_embeddings=r.opt("max_position_embeddings", int, 4096),
            rms_norm_eps=r.opt("rms_norm_eps", float, 1e-6),
            rope_theta=r.typed(theta, float, "rope_theta"),
            rope_scaling=parse_rope_scaling(scaling_d, d, source)
            if scaling_d and not family.own_rope
            else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias,
            o_bias=attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            eos_token_ids=tuple(eos)
            if isinstance(eos, list)
            else ((eos,) if isinstance(eos, int) else ()),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            quant_method=_quant_method(d.get("quantization_config"), source),
        )
        fields.update(family.hf_fields(r))
        try:
            return cls(**fields)
        except ConfigFieldError as e:  # __post_init__ validated it
            raise e.at(source) from None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str = "model config") -> None:
        """Every field within `INT_RANGES` / `FLOAT_RANGES` and consistent with the others;
        ConfigFieldError (naming field, value and range) or ConfigError otherwise."""
        try:
            self._check_fields()
        except ConfigFieldError as e:
            raise e.at(source) from None

    def _check_fields(self) -> None:
        self._check_ranges()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigFieldError(
                "num_key_value_heads", self.num_key_value_heads,
                f"a divisor of num_attention_heads = {self.num_attention_heads}",
            )  # fmt: skip
        if self.head_dim % 2:
            raise ConfigFieldError("head_dim", self.head_dim, "even (RoPE rotates pairs)")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigFieldError(
                "partial_rotary_factor", self.partial_rotary_factor,
                f"one giving an even rotary_dim >= 2 of head_dim {self.head_dim}",
            )  # fmt: skip
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(s, name)
                if len(factors) != self.rotary_dim // 2:
                    raise ConfigFieldError(
                        f"rope_scaling.{name}", f"{len(factors)} values",
                        f"rotary_dim / 2 = {self.rotary_dim // 2} values",
                    )  # fmt: skip

    def _check_ranges(self) -> None:
        for name, (lo, hi) in INT_RANGES.items():
            _check_int(name, getattr(self, name), lo, hi)
        values = {
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        s = self.rope_scaling
        if s is not None and s.rope_type != "longrope":  # longrope reads no `factor`
            values["rope_scaling.factor"] = s.factor
        if s is not None and s.rope_type == "llama3":  # linear scaling reads only the factor
            values["rope_scaling.low_freq_factor"] = s.low_freq_factor
            values["rope_scaling.high_freq_factor"] = s.high_freq_factor
        if s is not None and s.rope_type == "yarn":
            values["rope_scaling.beta_fast"] = s.beta_fast
            values["rope_scaling.beta_slow"] = s.beta_slow
            values["rope_scaling.attention_factor"] = s.attention_factor
        if s is not None and s.rope_type == "longrope":
            values["rope_scaling.attention_factor"] = s.attention_factor
            for name in ("short_factor", "long_factor"):
                for v in getattr(s, name):
                    lo, hi = FLOAT_RANGES[f"rope_scaling.{name}"]
                    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                        raise ConfigFieldError(f"rope_scaling.{name}", v, f"[{lo:g}, {hi:g}]")
        if s is not None and s.rope_type in ("llama3", "yarn", "longrope"):
            _check_int(
                "rope_scaling.original_max_position_embeddings",
                s.original_max_position_embeddings, 1, 1 << 24,
            )  # fmt: skip
        for name, v in values.items():
            lo, hi = FLOAT_RANGES[name]
            if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                raise ConfigFieldError(name, v, f"[{lo:g}, {hi:g}] (finite)")
        if s is not None and s.rope_type == "llama3" and not s.high_freq_factor > s.low_freq_factor:
            raise ConfigFieldError(
                "rope_scaling.high_freq_factor", s.high_freq_factor,
                f"(low_freq_factor = {s.low_freq_factor:g}, 1024]",
            )  # fmt: skip
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1, 1 << 24)
        if self.window_layers is not None and any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers
            for i in self.window_layers
        ):
            raise ConfigFieldError(
                "layer_types", self.window_layers, f"layers in [0, {self.num_hidden_layers})"
            )
        self._check_family_switches()
        if self.bos_token_id is not None:
            _check_int("bos_token_id", self.bos_token_id, 0, TOKEN_ID_MAX)
        if len(self.eos_token_ids) > MAX_EOS_IDS:
            raise ConfigFieldError(
                "eos_token_id", f"{len(self.eos_token_ids)} ids", f"at most {MAX_EOS_IDS} ids"
            )
        for t in self.eos_token_ids:
            _check_int("eos_token_id", t, 0, TOKEN_ID_MAX)
        if not isinstance(self.torch_dtype, str) or len(self.torch_dtype) > 32:
            raise ConfigFieldError("torch_dtype", self.torch_dtype, "a dtype name")
        if self.deltanet is not None:
            self.deltanet.validate(self.num_hidden_layers)
        if self.moe is not None:
            self.moe.validate(self.num_hidden_layers)
            mixtral = self.architecture == "MixtralForCausalLM"
            if mixtral and self.moe.intermediate_size != self.intermediate_size:
                raise ConfigFieldError(
                    "moe.intermediate_size", self.moe.intermediate_size,
                    f"Mixtral's intermediate_size ({self.intermediate_size}): its experts' width",
                )  # fmt: skip

    def _check_family_switches(self) -> None:
        """The switches a family sets (Gemma 3's): named values and bounded numbers; a quant
        method only where the family's checkpoints use it."""
        if self.quant_method is not None and self.quant_method not in self.family.quant_methods:
            methods = self.family.quant_methods
            raise UnsupportedQuantizationError(
                "quantization_config.quant_method",
                self.quant_method,
                f"{' or '.join(map(repr, methods))} for {self.architecture}"
                if methods
                else f"none for {self.architecture}: tandem reads its unquantized checkpoints",
            )
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigFieldError(
                "norm_placement", self.norm_placement, " or ".join(NORM_PLACEMENTS)
            )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ConfigFieldError(
                "mlp_activation", self.mlp_activation, " or ".join(MLP_ACTIVATIONS)
            )
        for name in ("rope_local_theta", "norm_weight_offset", "embed_scale"):
            _check_optional_float(name, getattr(self, name))
        _check_optional_float("query_pre_attn_scalar", self.query_pre_attn_scalar)
        if self.rope_local_theta is not None and self.sliding_window is None:
            raise ConfigFieldError(
                "rope_local_theta", self.rope_local_theta, "unset without a sliding window"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json Hugging Face `transformers` writes for this shape (old rope layout, which
        every transformers version reads)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf_dict() if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        d.update(self.family.hf_extras(self))
        return {k: v for k, v in d.items() if v is not OMIT}


def _quant_method(q: Any, source: str) -> Any:
    """config.json's `quantization_config` -> its `quant_method` (None when absent), checked
    against the family in `ModelConfig.validate`."""
    if q is None:
        return None
    if not isinstance(q, dict) or "quant_method" not in q:
        raise ConfigError(
            f"{source}: 'quantization_config' must be an object with a 'quant_method'"
        )
    return q["quant_method"]


def _text_config(d: dict[str, Any], source: str) -> dict[str, Any]:
    """A multimodal config.json's `text_config`, with the top level's token ids and dtype where
    the text config states none (Gemma 3's checkpoints keep them there)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a multimodal config needs a 'text_config' object")
    keep = ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings")
    return {**{k: d[k] for k in keep if k in d}, **text}


def _check_optional_float(name: str, v: Any) -> None:
    lo, hi = FLOAT_RANGES[name]
    if v is not None and (
        isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi
    ):
        raise ConfigFieldError(name, v, f"[{lo:g}, {hi:g}] (finite) or unset")


def _check_int(name: str, v: Any, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigFieldError(name, v, f"[{lo}, {hi}]")


def _typed(v: Any, kind: type, key: str, source: str) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{source}: field {key!r} must be a number, got {v!r}")
    if kind is int:
        if isinstance(v, float) and not math.isfinite(v) or int(v) != v:
            raise ConfigError(f"{source}: field {key!r} must be an integer, got {v!r}")
        return int(v)
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        raise ConfigFieldError(key, v, "a finite float", source) from None


class HFFields:
    """Typed reads of one config.json dict `d`, for the common parse and each family's
    `hf_fields`: `need` (a required field), `opt` (a default when absent or null), `typed`; a
    wrong type raises ConfigError naming the field and `source`."""

    def __init__(self, d: dict[str, Any], source: str) -> None:
        self.d, self.source = d, source

    def get(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def need(self, key: str, kind: type = int) -> Any:
        if key not in self.d or self.d[key] is None:
            raise ConfigError(f"{self.source}: required field {key!r} is missing")
        return _typed(self.d[key], kind, key, self.source)

    def opt(self, key: str, kind: type, default: Any) -> Any:
        v = self.d.get(key)
        return default if v is None else _typed(v, kind, key, self.source)

    def typed(self, v: Any, kind: type, key: str) -> Any:
        return _typed(v, kind, key, self.source)


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default attention factor (transformers' `get_mscale`): 0.1 m ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def alternating_window_layers(num_layers: int) -> tuple[int, ...]:
    """gpt-oss's sliding layers when nothing states them: the even-indexed ones (transformers'
    default `layer_types`, llama.cpp's swa pattern 2)."""
    return tuple(range(0, num_layers, 2))


def _parse_yarn(s: dict[str, Any], d: dict[str, Any], source: str) -> RopeScaling:
    """YaRN as transformers reads it (`_compute_yarn_parameters`): the attention factor stated, or
    from `mscale`/`mscale_all_dim`, or 0.1 ln(factor) + 1."""
    factor = _typed(s.get("factor"), float, "rope_scaling.factor", source)
    att = s.get("attention_factor")
    if att is not None:
        att = _typed(att, float, "rope_scaling.attention_factor", source)
    elif s.get("mscale") and s.get("mscale_all_dim"):
        m = _typed(s["mscale"], float, "rope_scaling.mscale", source)
        m_all = _typed(s["mscale_all_dim"], float, "rope_scaling.mscale_all_dim", source)
        att = yarn_attention_factor(factor, m) / yarn_attention_factor(factor, m_all)
    else:
        att = yarn_attention_factor(factor)
    original = s.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=_typed(
            original, int, "rope_scaling.original_max_position_embeddings", source
        ),
        beta_fast=_typed(s.get("beta_fast") or 32, float, "rope_scaling.beta_fast", source),
        beta_slow=_typed(s.get("beta_slow") or 1, float, "rope_scaling.beta_slow", source),
        truncate=bool(s.get("truncate", True)),
        attention_factor=att,
    )


def parse_rope_scaling(s: Any, d: dict[str, Any], source: str) -> RopeScaling:
    if not isinstance(s, dict):
        raise ConfigError(f"{source}: 'rope_scaling' must be an object")
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "yarn":
        if "factor" not in s:
            raise ConfigError(f"{source}: rope_scaling field 'factor' is missing")
        return _parse_yarn(s, d, source)
    if kind == "linear":
        if "factor" not in s:
            raise ConfigError(f"{source}: rope_scaling field 'factor' is missing")
        return RopeScaling("linear", _typed(s["factor"], float, "rope_scaling.factor", source))
    try:
        return RopeScaling(
            rope_type=kind,
            factor=_typed(s["factor"], float, "rope_scaling.factor", source),
            low_freq_factor=_typed(
                s["low_freq_factor"], float, "rope_scaling.low_freq_factor", source
            ),
            high_freq_factor=_typed(
                s["high_freq_factor"], float, "rope_scaling.high_freq_factor", source
            ),
            original_max_position_embeddings=_typed(
                s.get("original_max_position_embeddings", d.get("max_position_embeddings")),
                int,
                "rope_scaling.original_max_position_embeddings",
                source,
            ),
        )
    except KeyError as e:
        raise ConfigError(f"{source}: rope_scaling field {e.args[0]!r} is missing") from e
