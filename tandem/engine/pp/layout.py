"""From command-line choices to the stages of a pipeline grid (pure, no processes).

`--pp M` asks for M stages; `--tp N` makes each of them a TP group of N ranks, or `--layout 2,1`
gives each stage its own TP degree (stage 0 TP=2, stage 1 TP=1; M is then the list's length).
Layer ranges come from `tandem.parallel.partition`: by default each stage's speed is its TP degree
(ranks of one machine are alike), and the head's LM head is counted against stage 0; `--pp-weights`
overrides the split, and `--pp-weights auto` takes each stage's speed and memory from the probe its
processes run before loading (`auto_ranges`); without `--pp-weights`, `auto` is the default where
the stages' ranks differ in compute dtype or device (`ranks_differ`). `--dtype` / `--device` take one value for every rank or a comma list, one per
stage or one per rank (ranks numbered stage by stage). Each rank of a TP stage computes in its own
dtype (its ring reduces in float32 and returns each rank's sum in that rank's dtype,
`tandem.comm.ring`); a TP stage runs on its first rank's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tandem.parallel.partition import (
    LayerRange,
    StageCapacity,
    model_cost,
    parse_pp_weights,
    partition_layers,
)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per parameter of a compute dtype


class LayoutError(ValueError):
    """A --pp / --tp / --layout / --dtype combination that does not describe a grid."""


@dataclass(frozen=True)
class StageSpec:
    """One stage: its layers, its TP degree, and the compute dtype/device of its ranks.

    `dtype` is TP rank 0's compute dtype (the head's, for stage 0); `rank_dtypes`, when given,
    holds one per TP rank (`rank_dtypes[0] == dtype`), e.g. a bfloat16 rank beside a float16 one."""

    layers: LayerRange
    tp: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    rank_dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rank_dtypes and (
            len(self.rank_dtypes) != self.tp or self.rank_dtypes[0] != self.dtype
        ):
            raise LayoutError(
                f"rank dtypes {list(self.rank_dtypes)}: give one per TP rank ({self.tp}), the "
                f"first being the stage's dtype {self.dtype!r}"
            )

    def dtype_of(self, tp_rank: int) -> str:
        """TP rank `tp_rank`'s compute dtype."""
        return self.rank_dtypes[tp_rank] if self.rank_dtypes else self.dtype

    @property
    def widest_bytes(self) -> int:
        """Bytes per parameter of the stage's widest compute dtype."""
        return max(_BYTES.get(self.dtype_of(r), 4) for r in range(self.tp))


def parse_layout(text: str | None, pp: int | None, tp: int = 1) -> tuple[int, ...]:
    """The TP degree of each stage: `--layout 2,1`, or `pp` stages of `tp` ranks each."""
    if text:
        try:
            layout = tuple(int(x) for x in text.split(","))
        except ValueError as e:
            raise LayoutError(f"--layout {text!r}: not a comma-separated list of TP degrees") from e
        if pp not in (None, 1, len(layout)):
            raise LayoutError(f"--layout {text!r} has {len(layout)} stages but --pp is {pp}")
    else:
        layout = (tp,) * (pp or 1)
    if not layout or min(layout) < 1:
        raise LayoutError(f"every stage needs a TP degree of at least 1, got {list(layout)}")
    return layout


def per_stage_ranks(value: str, layout: Sequence[int], what: str) -> list[list[str]]:
    """One value per rank of each stage from one value, a value per stage (every rank of stage k
    takes value k), or a value per rank (ranks numbered stage by stage)."""
    parts = [v.strip() for v in value.split(",")]
    if len(parts) == 1:
        return [parts * tp for tp in layout]
    if len(parts) == len(layout):
        return [[p] * tp for p, tp in zip(parts, layout)]
    if len(parts) == sum(layout):
        out, r = [], 0
        for tp in layout:
            out.append(parts[r : r + tp])
            r += tp
        return out
    raise LayoutError(
        f"--{what} {value!r}: give one value, one per stage ({len(layout)}) or one per rank ({sum(layout)})"
    )


def plan_stages(
    config,
    layout: Sequence[int],
    *,
    pp_weights: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    speeds: Sequence[float] | None = None,
) -> list[StageSpec]:
    """The stages of the grid `layout` for `config`, with their layer ranges."""
    n = len(layout)
    weights = parse_pp_weights(pp_weights, n) if pp_weights else None
    caps = [StageCapacity(speed=float(s)) for s in (speeds or layout)]
    ranges = partition_layers(caps, model_cost(config), weights)
    dtypes = per_stage_ranks(dtype, layout, "dtype")
    devices = [d[0] for d in per_stage_ranks(device, layout, "device")]  # the first rank's
    return [
        StageSpec(r, tp, dt[0], dev, tuple(dt) if len(set(dt)) > 1 else ())
        for r, tp, dt, dev in zip(ranges, layout, dtypes, devices)
    ]


@dataclass(frozen=True)
class StageProbe:
    """What one stage's ranks measured before loading: each rank's decode GEMV GB/s and free GB."""

    gemv_gb_s: tuple[float, ...]
    free_gb: tuple[float, ...]

    def capacity(self, bytes_per_param: int) -> StageCapacity:
        """A TP stage splits its layers evenly over its ranks, so it runs at its slowest rank's
        speed times its degree and holds its smallest rank's memory times its degree. The speed is
        in parameters per second (GB/s over the dtype's bytes per parameter), so a bfloat16 stage
        and a float32 stage compare by the layers they get through, not the bytes."""
        n = len(self.gemv_gb_s)
        return StageCapacity(
            memory_bytes=int(n * min(self.free_gb) * 1e9),
            speed=n * min(self.gemv_gb_s) / bytes_per_param,
            bytes_per_param=bytes_per_param,
        )

    def as_dict(self) -> dict:
        return {
            "gemv_gb_s": [round(g, 3) for g in self.gemv_gb_s],
            "free_gb": [round(f, 3) for f in self.free_gb],
        }


def auto_ranges(
    config, stages: Sequence[StageSpec], probes: Sequence[StageProbe]
) -> list[StageSpec]:
    """`stages` with their layer ranges replaced by `partition_layers` over the probed speeds and
    memory (stage i's time per token is its layers' bytes over its measured GEMV bytes/s; the
    head's LM head is counted against stage 0). Memory the stages share (one host's RAM) is
    counted once per stage, so the memory bound is loose there."""
    caps = [p.capacity(s.widest_bytes) for s, p in zip(stages, probes, strict=True)]
    ranges = partition_layers(caps, model_cost(config))
    return [replace(s, layers=r) for s, r in zip(stages, ranges)]


def ranks_differ(stages: Sequence[StageSpec]) -> str | None:
    """Why the stages' ranks differ (compute dtypes or devices, in words), or None where every
    rank is alike: a pipeline of unlike ranks is split by the probe unless `--pp-weights` says
    otherwise, one of alike ranks by TP degree (no probe noise where nothing differs)."""
    dtypes = [s.dtype_of(r) for s in stages for r in range(s.tp)]
    devices = [s.device for s in stages]
    differ = [
        f"{what} {'/'.join(dict.fromkeys(vals))}"
        for what, vals in (("dtype", dtypes), ("device", devices))
        if len(set(vals)) > 1
    ]
    return f"the ranks differ in {', '.join(differ)}" if differ else None


def describe_auto(stages: Sequence[StageSpec], probes: Sequence[dict]) -> str:
    """One line: each stage's chosen layers and the probe they came from."""
    parts = [
        f"stage {k} layers {s.layers.start}:{s.layers.end} (GEMV GB/s {p['gemv_gb_s']}, "
        f"free GB {p['free_gb']})"
        for k, (s, p) in enumerate(zip(stages, probes))
    ]
    return "--pp-weights auto: " + "; ".join(parts)
