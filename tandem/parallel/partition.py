"""Pipeline partition: which contiguous layers each stage runs (pure functions, no torch).

A stage owns a half-open range of global layer indices `[start, end)`; the ranges of a pipeline are
contiguous, ascending, non-empty, and cover `[0, num_layers)` exactly once. Stage 0 is the head: it
also holds the embedding, the final norm and the LM head, and runs the LM head every step.

Cost model (decode is memory-bound, so the time a stage spends per token is the bytes it reads
divided by its speed). With `L` layers of `c` parameters each, a head extra of `h` parameters read
per token (final norm + LM head; the embedding reads one row, which we count as free), stage `i` at
relative speed `s_i` holding `n_i` layers takes

    t_i = (n_i * c + [i == 0] * h) / s_i

and we pick integers `n_i >= 1` with `sum n_i = L` and `n_i <= cap_i` (its memory) minimizing
`max_i t_i`. Layers are identical jobs on uniform machines, so handing out layers one at a time to the
stage that would finish earliest (ties to the lower stage index) is optimal and deterministic.

Mixture of experts. A sparse layer holds all E experts but a token reads only the k it is routed
to, so a layer's parameters split in two (`layer_read_params`, `layer_held_params`), with
`A` = attention (its biases included), `w` the expert width, `s` the shared expert's width (0: none), `F` the dense MLP:

    read(layer) = A + E D + k 3 D w + 3 D s + [s > 0] D     held(layer) = A + E D + E 3 D w + ...
    read = held = A + 3 D F                                  (a dense layer, dense among sparse too)

(the router reads its whole E x D matrix every token). Speed is weighed with the reads (`c` above
is the mean read per layer), memory with what is held: a stage's memory cap counts the largest
layer held, so a stage is never given layers it cannot hold (with dense layers among sparse ones
it may be given one fewer than it could). Qwen3-30B-A3B's shape reads ~3.3 B parameters per token
(embedding included, as its model card counts) of ~30.5 B held.

`--pp-weights` overrides the cost model: layers are split in proportion to the given weights
(largest remainder, ties to the lower stage index: `apportion.py`), still at least one layer per
stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.parallel.apportion import Span, apportion, spans

# The name the pipeline code gives a stage's layers `[start, end)`: the same type, not another one.
LayerRange = Span


class PartitionError(ValueError):
    """A pipeline partition that cannot be built or is not valid."""


class InvalidWeightsError(PartitionError):
    """Stage weights or speeds that do not parse, are not positive or do not match the stage count."""


class EmptyStageError(PartitionError):
    """A stage that would hold no layer (more stages than layers, or a weight too small)."""


class LayerCoverageError(PartitionError):
    """Ranges that skip a layer, repeat one, are not ascending or run past the model."""


class CapacityError(PartitionError):
    """The layers do not fit in the stages' memory."""


@dataclass(frozen=True)
class StageCapacity:
    """What one stage can give: `memory_bytes` for weights (None: unbounded), relative `speed`
    (measured, e.g. GB/s of weight reads or tok/s; only ratios matter), and the bytes per
    parameter of its compute dtype."""

    memory_bytes: int | None = None
    speed: float = 1.0
    bytes_per_param: int = 4


@dataclass(frozen=True)
class ModelCost:
    """Parameter counts the partition weighs: per decoder layer, read per token (`layer_params`,
    the mean over the layers) and held in memory (`layer_held_params`, the largest layer; None:
    the same as read, a dense model); read by the head per token (final norm + LM head), and held
    by the head in memory (embedding + final norm + LM head, the tied matrix once)."""

    num_layers: int
    layer_params: int
    head_compute_params: int
    head_memory_params: int
    layer_held_params: int | None = None

    @property
    def held_per_layer(self) -> int:
        return self.layer_params if self.layer_held_params is None else self.layer_held_params


def _attention_and_norms(config) -> int:
    d, n_q, n_kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // n_q
    attn = d * hd * (n_q + 2 * n_kv) + n_q * hd * d
    biases = hd * (n_q + 2 * n_kv) * bool(getattr(config, "qkv_bias", False))
    biases += d * bool(getattr(config, "o_bias", False))
    return attn + biases + 2 * d + (2 * hd if getattr(config, "qk_norm", False) else 0)


def _sparse(config, layer: int) -> bool:
    moe = getattr(config, "moe", None)
    return moe is not None and moe.is_sparse(layer)


def _ffn_params(config, layer: int, experts: int) -> int:
    """Layer `layer`'s feed-forward with `experts` of its experts counted (module docstring)."""
    d = config.hidden_size
    if not _sparse(config, layer):
        return 3 * d * config.intermediate_size
    spec = config.moe
    shared = 3 * d * spec.shared_intermediate_size + d if spec.shared_intermediate_size else 0
    return spec.num_experts * d + experts * 3 * d * spec.intermediate_size + shared


def layer_read_params(config, layer: int) -> int:
    """Parameters decoder layer `layer` reads per token: attention, norms, and its dense MLP or
    router + top-k experts + shared expert (module docstring)."""
    k = config.moe.top_k if _sparse(config, layer) else 0
    return _attention_and_norms(config) + _ffn_params(config, layer, k)


def layer_held_params(config, layer: int) -> int:
    """Parameters decoder layer `layer` holds: as read, with every expert (module docstring)."""
    e = config.moe.num_experts if _sparse(config, layer) else 0
    return _attention_and_norms(config) + _ffn_params(config, layer, e)


def model_cost(config) -> ModelCost:
    """The `ModelCost` of a Llama-family config, dense or mixture of experts (HF attribute names,
    `config.moe` a `MoESpec`; duck-typed)."""
    d, L = config.hidden_size, config.num_hidden_layers
    lm_head = config.vocab_size * d
    tied = bool(getattr(config, "tie_word_embeddings", False))
    read = sum(layer_read_params(config, i) for i in range(L))
    return ModelCost(
        num_layers=L,
        layer_params=read // L,
        head_compute_params=lm_head + d,
        head_memory_params=(lm_head if tied else 2 * lm_head) + d,
        layer_held_params=max(layer_held_params(config, i) for i in range(L)),
    )


def parse_pp_weights(text: str, num_stages: int) -> tuple[float, ...]:
    """`"2,1"` -> `(2.0, 1.0)`; one positive finite weight per stage, or `InvalidWeightsError`."""
    parts = [p.strip() for p in text.split(",")]
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError as e:
        raise InvalidWeightsError(
            f"--pp-weights {text!r}: not a comma-separated list of numbers"
        ) from e
    if len(weights) != num_stages:
        raise InvalidWeightsError(
            f"--pp-weights {text!r} gives {len(weights)} weights for {num_stages} stages"
        )
    _check_positive(weights, "--pp-weights")
    return weights


def _check_positive(values: Sequence[float], what: str) -> None:
    for v in values:
        if not math.isfinite(v) or v <= 0:
            raise InvalidWeightsError(f"{what}: every value must be positive and finite, got {v}")


def _check_counts(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise EmptyStageError("a pipeline needs at least one stage")
    if num_layers < num_stages:
        raise EmptyStageError(
            f"{num_stages} stages for {num_layers} layers: every stage needs at least one layer"
        )


def split_by_weights(num_layers: int, weights: Sequence[float]) -> tuple[Span, ...]:
    """Layers in proportion to `weights` (largest remainder), at least one per stage.

    Stage i's ideal share is `L * w_i / sum(w)`; each gets the floor, the leftover layers go to the
    largest fractional parts (ties to the lower index). A stage whose share rounds to zero fails.
    """
    _check_counts(num_layers, len(weights))
    _check_positive(weights, "stage weights")
    counts = apportion(num_layers, weights)
    for i, n in enumerate(counts):
        if n == 0:
            raise EmptyStageError(
                f"stage {i} gets no layer with weights {list(weights)} over {num_layers} layers"
            )
    return validate_ranges(spans(counts), num_layers)


def partition_layers(
    stages: Sequence[StageCapacity], cost: ModelCost, weights: Sequence[float] | None = None
) -> tuple[Span, ...]:
    """One `Span` per stage (stage 0 is the head), minimizing the slowest stage's time per
    token under the stages' memory, or split by explicit `weights` (the `--pp-weights` override)."""
    num_layers = cost.num_layers
    _check_counts(num_layers, len(stages))
    _check_positive([s.speed for s in stages], "stage speeds")
    caps = [_layer_cap(i, s, cost) for i, s in enumerate(stages)]
    if weights is not None:
        if len(weights) != len(stages):
            raise InvalidWeightsError(f"{len(weights)} weights for {len(stages)} stages")
        ranges = split_by_weights(num_layers, weights)
        for i, r in enumerate(ranges):
            if len(r) > caps[i]:
                raise CapacityError(
                    f"stage {i} is given {len(r)} layers by the weights but its memory holds {caps[i]}"
                )
        return ranges
    if sum(caps) < num_layers:
        raise CapacityError(
            f"the stages' memory holds {sum(caps)} of {num_layers} layers; add a node or memory"
        )
    counts = [1] * len(stages)

    def finish_time(i: int, n: int) -> float:
        extra = cost.head_compute_params if i == 0 else 0
        return (n * cost.layer_params + extra) / stages[i].speed

    for _ in range(num_layers - len(stages)):
        open_stages = [i for i in range(len(stages)) if counts[i] < caps[i]]
        best = min(open_stages, key=lambda i: (finish_time(i, counts[i] + 1), i))
        counts[best] += 1
    return validate_ranges(spans(counts), num_layers)


def _layer_cap(i: int, stage: StageCapacity, cost: ModelCost) -> int:
    """How many layers fit in stage i's memory after the head's embedding and LM head."""
    if stage.memory_bytes is None:
        return cost.num_layers
    fixed = cost.head_memory_params * stage.bytes_per_param if i == 0 else 0
    per_layer = max(1, cost.held_per_layer * stage.bytes_per_param)
    cap = (stage.memory_bytes - fixed) // per_layer
    if cap < 1:
        raise CapacityError(
            f"stage {i} has {stage.memory_bytes} bytes: not enough for one layer"
            + (" next to the embedding and LM head" if i == 0 else "")
        )
    return min(int(cap), cost.num_layers)


def validate_ranges(ranges: Sequence[Span], num_layers: int) -> tuple[Span, ...]:
    """Every layer in `[0, num_layers)` exactly once, ascending, no empty stage; else a typed error."""
    if not ranges:
        raise EmptyStageError("a pipeline needs at least one stage")
    expected = 0
    for i, r in enumerate(ranges):
        if r.end <= r.start:
            raise EmptyStageError(f"stage {i} has the empty range {r}")
        if r.start != expected:
            what = "skips" if r.start > expected else "repeats"
            raise LayerCoverageError(f"stage {i} range {r} {what} layers from {expected}")
        expected = r.end
    if expected != num_layers:
        raise LayerCoverageError(
            f"the stages cover [0, {expected}) but the model has {num_layers} layers"
        )
    return tuple(ranges)


def parse_ranges(text: str, num_layers: int) -> tuple[Span, ...]:
    """`"0:9,9:28"` -> validated ranges (an explicit partition, e.g. for a multi-machine config)."""
    out = []
    for part in text.split(","):
        try:
            a, b = part.split(":")
            out.append(Span(int(a), int(b)))
        except ValueError as e:
            raise LayerCoverageError(f"layer range {part!r} is not START:END") from e
    return validate_ranges(out, num_layers)
