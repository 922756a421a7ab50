"""`DeltaNetSpec`: the Gated DeltaNet part of a hybrid model's shape (Qwen3.5 / Qwen3.6), as its HF
config states it; torch-free (`config` and the GGUF loader read it).

    config.json field          meaning                                        DeltaNetSpec field
    layer_types                "linear_attention" layers hold a Gated         linear_layers
                               DeltaNet, "full_attention" ones gated
                               attention (absent: every full_attention_
                               interval-th layer is full, the rest linear)
    linear_num_key_heads       q/k heads Hk                                   num_key_heads
    linear_num_value_heads     v heads Hv (a multiple of Hk: each q/k head    num_value_heads
                               serves Hv / Hk consecutive v heads)
    linear_key_head_dim        dk                                             key_head_dim
    linear_value_head_dim      dv                                             value_head_dim
    linear_conv_kernel_dim     the causal conv's window K                     conv_kernel

Two switches say how the weights are stored. HF checkpoints order v heads grouped by their q/k head
(v head j served by q/k head j // (Hv / Hk)) and store A_log; llama.cpp's converter (GGUF
`qwen35`, `qwen35moe`) reorders them tiled (v head j served by q/k head j % Hk: `v_tiled`) and
stores A = -exp(A_log) itself (`a_log` False). Every per-v-head tensor moves together, so a
model reads either order as stored and only the q/k-to-v expansion differs.

A DeltaNet layer keeps, per sequence, a conv window (2 Hk dk + Hv dv channels x (K - 1) inputs)
and a dk x dv matrix per v head instead of a KV cache (`state_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass

LINEAR, FULL = "linear_attention", "full_attention"
DEFAULT_FULL_INTERVAL = 4  # transformers' full_attention_interval


@dataclass(frozen=True)
class DeltaNetSpec:
    """The DeltaNet layers of a hybrid model and their head shape (module docstring)."""

    linear_layers: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    # how the weights order and state a layer's v heads and decay (module docstring)
    v_tiled: bool = False
    a_log: bool = True

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k (Hk dk each) and v (Hv dv), concatenated."""
        return (
            2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        )

    def state_elements(self) -> tuple[int, int]:
        """(conv window, recurrent matrix) elements one sequence holds in one layer."""
        return (
            self.conv_dim * (self.conv_kernel - 1),
            self.num_value_heads * self.key_head_dim * self.value_head_dim,
        )

    def validate(self, num_layers: int) -> None:
        from tandem.config import ConfigFieldError

        checks = (
            ("linear_num_key_heads", self.num_key_heads, 1, 1024),
            ("linear_num_value_heads", self.num_value_heads, 1, 4096),
            ("linear_key_head_dim", self.key_head_dim, 1, 1024),
            ("linear_value_head_dim", self.value_head_dim, 1, 1024),
            ("linear_conv_kernel_dim", self.conv_kernel, 2, 64),
        )
        for name, v, lo, hi in checks:
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigFieldError(name, v, f"[{lo}, {hi}]")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigFieldError(
                "linear_num_value_heads", self.num_value_heads,
                f"a multiple of linear_num_key_heads = {self.num_key_heads}",
            )  # fmt: skip
        if any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
            for i in self.linear_layers
        ):
            raise ConfigFieldError("layer_types", self.linear_layers, f"[0, {num_layers})")


def layer_types(spec: DeltaNetSpec | None, num_layers: int) -> list[str]:
    """config.json's `layer_types` for `spec` (every layer full without one)."""
    linear = set(spec.linear_layers) if spec is not None else set()
    return [LINEAR if i in linear else FULL for i in range(num_layers)]


def linear_layers_of(types: list[str] | None, num_layers: int, interval: int) -> tuple[int, ...]:
    """The DeltaNet layers from `layer_types`, or, absent, from `full_attention_interval`
    (layer i full when (i + 1) % interval == 0); ValueError naming an unknown type."""
    if types is None:
        return tuple(i for i in range(num_layers) if (i + 1) % interval)
    unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
    if unknown or len(types) != num_layers:
        raise ValueError(
            f"layer_types must be {num_layers} of {LINEAR!r} / {FULL!r}"
            + (f"; unknown: {', '.join(map(repr, unknown))}" if unknown else "")
        )
    return tuple(i for i, t in enumerate(types) if t == LINEAR)
