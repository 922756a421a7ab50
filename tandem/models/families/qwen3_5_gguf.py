"""The Qwen3.5 hybrid's GGUF side (`qwen35`, `qwen35moe`), as llama.cpp's converter writes a file
(`Qwen3_5TextModel` / `Qwen3_5MoeTextModel` over `_LinearAttentionVReorderBase` and
`Qwen3NextModel`) and gguf-py names its tensors and keys. Torch-free.

    HF (model.layers.N.)            GGUF (blk.N.)          stored
    linear_attn.in_proj_qkv         attn_qkv               v rows tiled (below)
    linear_attn.in_proj_z           attn_gate              rows tiled
    linear_attn.in_proj_a / _b      ssm_alpha / ssm_beta   rows tiled
    linear_attn.conv1d              ssm_conv1d             (C, K): the size-1 dim dropped, v
                                                           channels tiled
    linear_attn.A_log               ssm_a                  A = -exp(A_log), tiled
    linear_attn.dt_bias             ssm_dt.bias            tiled
    linear_attn.norm                ssm_norm               w (plain, per v head's dv)
    linear_attn.out_proj            ssm_out                columns tiled
    post_attention_layernorm        post_attention_norm
    every other *norm.weight        (shared names)         1 + w
    self_attn.q_proj                attn_q                 as HF: per head hd query, hd gate rows

Tiled: v heads reordered from HF's grouped order (q/k head g's r = Hv / Hk v heads together) to
[head 0 of every group, head 1 of every group, ...], so v head j is served by q/k head j % Hk
(`DeltaNetSpec.v_tiled`); tandem reads the file in that order without reordering it back.

Keys (`qwen35.`): ssm.conv_kernel K, ssm.state_size dk, ssm.group_count Hk, ssm.time_step_rank Hv,
ssm.inner_size Hv dv, attention.recurrent_layers (a bool per layer, true for DeltaNet; the
converter writes it from layer_types, and llama.cpp reads it before the interval),
full_attention_interval n (layer i full when (i + 1) % n == 0: where recurrent_layers is absent;
written only where the pattern is one), rope.dimension_count (the rotary width),
rope.dimension_sections (M-RoPE's split of it, which text does not feel: written as all on the
first section). Past those, tandem's writer and the converter write the same tensors byte for
byte (scripts/bench/qwen35_llamacpp.py --writer-check).

llama.cpp's loader takes both DeltaNet head widths from ssm.state_size (dv = dk), as every released
checkpoint has them, so it refuses a file with dv != dk (`attn_qkv has wrong shape`) whichever
writer made it; tandem reads dv from ssm.inner_size / Hv and runs such a file.
"""

from __future__ import annotations

from typing import Any

from tandem.config import ConfigError
from tandem.deltanet_config import DEFAULT_FULL_INTERVAL, DeltaNetSpec

RECURRENT_LAYERS = "attention.recurrent_layers"  # gguf-py's Keys.Attention.RECURRENT_LAYERS
GGUF_NAMES: dict[str, str] = {  # HF module -> GGUF, where qwen35 differs from the shared table
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "post_attention_layernorm": "post_attention_norm",
}


def _tiled(x: Any, dim: int, groups: int, per_group: int, width: int) -> Any:
    """x with its `groups * per_group` heads of `width` along `dim` reordered from grouped to
    tiled (module docstring)."""
    shape = list(x.shape)
    x = x.reshape(*shape[:dim], groups, per_group, width, *shape[dim + 1 :])
    return x.transpose(dim, dim + 1).reshape(shape)


def gguf_store(c: Any, hf: str, x: Any) -> Any:
    """Tensor `hf` as llama.cpp's converter stores it (module docstring)."""
    s = c.deltanet
    if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
        return x + 1.0
    if ".linear_attn." not in hf:
        return x
    hk, hv, dk, dv = s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim
    r = hv // hk
    leaf = hf.split(".linear_attn.", 1)[1]
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        if leaf == "conv1d.weight":
            x = x.reshape(x.shape[0], x.shape[-1])  # (C, 1, K) -> (C, K)
        out = x.clone()  # q and k rows as they are, the v rows tiled
        out[2 * hk * dk :] = _tiled(x[2 * hk * dk :], 0, hk, r, dv)
        return out
    if leaf == "in_proj_z.weight":
        return _tiled(x, 0, hk, r, dv)
    if leaf in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias"):
        return _tiled(x, 0, hk, r, 1)
    if leaf == "A_log":
        return _tiled(-x.exp(), 0, hk, r, 1)
    if leaf == "out_proj.weight":
        return _tiled(x, 1, hk, r, dv)
    return x


def gguf_write(w: Any, c: Any) -> None:
    """The `qwen35.*` keys beyond the shared ones (module docstring)."""
    s = c.deltanet
    n = c.num_hidden_layers
    full = [i for i in range(n) if i not in s.linear_layers]
    interval = full[0] + 1 if full else n + 1
    w.add_ssm_conv_kernel(s.conv_kernel)
    w.add_ssm_state_size(s.key_head_dim)
    w.add_ssm_group_count(s.num_key_heads)
    w.add_ssm_time_step_rank(s.num_value_heads)
    w.add_ssm_inner_size(s.num_value_heads * s.value_head_dim)
    w.add_array(f"{w.arch}.{RECURRENT_LAYERS}", [i in s.linear_layers for i in range(n)])
    if [i for i in range(n) if (i + 1) % interval == 0] == full:
        w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(c.rotary_dim)
    w.add_rope_dimension_sections([c.rotary_dim // 2, 0, 0, 0])


def gguf_fields(g: Any) -> dict[str, Any]:
    """The ModelConfig fields a `qwen35` / `qwen35moe` file sets beyond the shared ones."""
    import math

    get, a = g.meta.get, g.a
    hv = get(a + "ssm.time_step_rank", int)
    inner = get(a + "ssm.inner_size", int)
    interval = get(a + "full_attention_interval", int, DEFAULT_FULL_INTERVAL)
    linear = tuple(i for i in range(g.layers) if (i + 1) % max(interval, 1))
    if a + RECURRENT_LAYERS in g.meta:  # a bool per layer: what llama.cpp reads first
        flags = get(a + RECURRENT_LAYERS, list)
        if len(flags) != g.layers:
            raise ConfigError(
                f"{g.meta.file}: {a}{RECURRENT_LAYERS} has {len(flags)} values for {g.layers} layers"
            )
        linear = tuple(i for i in range(g.layers) if flags[i])
    rotary = get(a + "rope.dimension_count", int, g.head_dim)
    partial = rotary / g.head_dim if g.head_dim else 1.0
    while g.head_dim and int(g.head_dim * partial) < rotary:  # int() must give rotary back
        partial = math.nextafter(partial, 2.0)
    spec = DeltaNetSpec(
        linear_layers=linear,
        num_key_heads=get(a + "ssm.group_count", int),
        num_value_heads=hv,
        key_head_dim=get(a + "ssm.state_size", int),
        value_head_dim=inner // hv if hv else 0,
        conv_kernel=get(a + "ssm.conv_kernel", int),
        v_tiled=True,
        a_log=False,
    )
    return {
        "deltanet": spec,
        "attn_output_gate": True,
        "qk_norm": True,
        "norm_weight_offset": 0.0,  # the file holds 1 + w
        "partial_rotary_factor": min(partial, 1.0),
    }
