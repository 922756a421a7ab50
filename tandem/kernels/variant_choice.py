"""Which ISA variant's build multiplies each weight type, chosen by timing on the model itself.

The fastest build is not the widest one everywhere: on a Sapphire Rapids VM the AVX-512 build
decoded SmolLM2's Q4_1 blocks slower than the AVX2 one. Nor is one way of streaming a dense
matrix: two rows of W a step with software prefetch decoded a BF16 model 1.28x faster than one
row without on that Sapphire Rapids, and 1.07x slower on a Zen 3 (`library.ONE_ROW`, the same
bits either way). So, at first use on a machine, for each weight type of the model and each
shape class (decode: 1 row of X; prefill: PREFILL_ROWS), every kernel the host runs multiplies
the model's own weights of that type: every variant's build (`library.variants()`), and for a
dense type's decode each build in both forms ("avx2", "avx2/1row", ...; `candidates`):

- the sample: the model's projections whose parts are all of the type, in model order, up to
  DECODE_SAMPLE_BYTES (prefill: PREFILL_SAMPLE_BYTES) of blocks, the last one cut to its first
  rows; x random, float32;
- a pass: one `tandem_qgemv` per projection in the sample, on the model's thread count;
- where it reads them: a decode token reads every weight of the model once, so where those bytes
  exceed the last-level cache (`llc_bytes`, sysfs) decode streams them from DRAM, and so does
  each timed decode pass: its sample is evicted from every cache level (csrc/gemv.c
  tandem_evict, CLFLUSH) before it, untimed. A model that fits the LLC is timed as decode reads
  it, from the caches. (A sample timed from the caches rates the kernels by their arithmetic:
  there AVX2 beat AVX-512 on Q8_0 blocks that AVX-512 reads ~8% faster from DRAM.) Prefill is
  compute-bound and timed from the caches;
- ROUNDS rounds, each timing one pass of every variant back to back in an order rotated each
  round (A B C, B C A, ...), after one warm pass each; a variant's figure is the median over the
  rounds of its pass time over AVX2's pass in the same round, so a noisy neighbour that stalls
  one pass, or loads the machine for a while, does not decide;
- the choice: the lowest such median ratio, if it is below 1 - MARGIN (1 - FORM_MARGIN for
  AVX2's other decode form: the same build and bits, only its speed at stake); else AVX2 in its
  default form (the build every x86-64 host of this project runs and the one the kernels were
  tuned on: a wider build, or another form, must earn its place). Where any variant's passes
  spread past NOISY (slowest / fastest), the machine was too busy to tell: AVX2 is kept for
  this run and nothing is cached, so the next run times again.

The primary library then routes that type and class to the chosen build (`library.route`). The
choice is cached in `$TANDEM_CACHE/native/choices.json`, keyed by the CPU model, the probed
features, the kernels' source hash, the thread count, the sample's shapes and where it was read
from (DRAM or the caches), so the next run on
this machine and model skips the timing. `TANDEM_KERNEL_VARIANT` forces one build for everything
in its default form (no timing, no routing): the benchmarks compare variants with it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.kernels import cpu_isa, library
from tandem.kernels.cstructs import TqPart
from tandem.models.quant.blocks import layout

MARGIN = 0.05  # another variant must beat AVX2's median pass by 5% to be chosen
# AVX2's other decode form (same build, same bits) by 2%: a Zen 3 timing an F32 model's forms
# 8 times measured one row at 0.92-0.94 of two rows (the whole model decoded 1.19x faster one
# row a step); a 5% margin kept two rows in 1 of 8 timings when the pass ratio came out 0.958
FORM_MARGIN = 0.02
ROUNDS = 7
NOISY = 1.5  # passes of one variant spread past this: a busy machine, AVX2 kept, not cached
PREFILL_ROWS = 64
# decode streams the weights: a sample well past the L2 caches, and long enough a pass (~3 ms
# from DRAM) that its start does not decide: a Zen 3 timing a BF16 model's two decode forms on
# 16 MiB chose one row in 1 of 6 runs (ratios 0.94-1.03), on 64 MiB in 6 of 6 (0.89-0.93; the
# whole model decoded 1.06x faster one row a step)
DECODE_SAMPLE_BYTES = 64 << 20
PREFILL_SAMPLE_BYTES = 256 << 10  # prefill is compute-bound: one projection shows the rate
MIN_ROWS = 32  # csrc/qgemv.c's chunk of rows
ROWS = {"decode": 1, "prefill": PREFILL_ROWS}
BASELINE = "avx2"
CHOICES_FILE = "choices.json"
SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
DEFAULT_LLC = 32 << 20  # where sysfs names no cache: a server's L3, so large models stream


class Projection(Protocol):
    """What the timing multiplies (`lean.linear.Linear` is one)."""

    parts: ctypes.Array  # TqPart * n
    types: tuple[int, ...]
    in_features: int
    out_features: int


def decide(passes: dict[str, Sequence[float]]) -> str:
    """The variant to take from interleaved pass times {variant: [seconds per round]}: of those
    whose median ratio to AVX2's pass of the same round is below 1 - MARGIN (1 - FORM_MARGIN for
    AVX2 in its other form), the lowest; else AVX2. Without AVX2 among them: the lowest median
    time."""
    if BASELINE not in passes:
        return min(passes, key=lambda n: statistics.median(passes[n]))

    def earns(name: str, ratio: float) -> bool:
        same_build = library.split_kernel(name)[0] == BASELINE
        return ratio < 1 - (FORM_MARGIN if same_build else MARGIN)

    winners = {n: r for n, r in relative(passes).items() if n != BASELINE and earns(n, r)}
    return min(winners, key=winners.__getitem__) if winners else BASELINE


def is_noisy(passes: dict[str, Sequence[float]]) -> bool:
    """The machine was too busy to trust a win: some variant's second slowest pass took over
    NOISY times its fastest (a neighbour took the cores for more than one pass)."""
    return any(sorted(ts)[-2] > NOISY * min(ts) for ts in passes.values() if len(ts) > 1)


def relative(passes: dict[str, Sequence[float]]) -> dict[str, float]:
    """{variant: median over rounds of its pass time / AVX2's in the same round}: pairing the
    passes of one round cancels a neighbour's load that spans the round."""
    base = passes[BASELINE]
    return {
        n: statistics.median(t / b for t, b in zip(ts, base, strict=True))
        for n, ts in passes.items()
    }


def llc_bytes(caches: Path = SYSFS_CACHES) -> int:
    """The size of the last-level cache cpu0 reads through (the highest `level` among its
    data and unified caches in sysfs: index*/level, type, size such as "491520K"), or
    DEFAULT_LLC where sysfs does not say."""
    best = (0, DEFAULT_LLC)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for d in caches.glob("index*"):
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
            nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError, IndexError):
            continue
        if kind in ("Data", "Unified") and level > best[0]:
            best = (level, nbytes)
    return best[1]


def _row_bytes(type_id: int, in_features: int) -> int:
    """Bytes a row of `type_id` takes (tandem's repacked types too, library.REPACKED)."""
    return library.kernel_row_bytes(type_id, in_features)[1]


def _name(type_id: int) -> str:
    return library.REPACKED[type_id][0] if type_id in library.REPACKED else layout(type_id).name


def weight_bytes(projections: Sequence[Projection]) -> int:
    """The bytes of every part of `projections`: what one decode token reads of them."""
    return sum(pt.rows * _row_bytes(pt.type, p.in_features) for p in projections for pt in p.parts)


def decode_reads_dram(projections: Sequence[Projection], llc: int | None = None) -> bool:
    """Whether a decode token's weight read (all of `projections`) exceeds the last-level cache,
    so each token reads them from DRAM (module docstring)."""
    return weight_bytes(projections) > (llc_bytes() if llc is None else llc)


@dataclass(frozen=True)
class Call:
    """One timed product: `parts` (TqPart * n, rows possibly cut short), K, the rows they add."""

    parts: ctypes.Array
    in_features: int
    out_features: int


def sample(projections: Sequence[Projection], type_id: int, budget: int) -> list[Call]:
    """The projections all of `type_id`, in model order, until `budget` bytes of blocks: the
    last one taken (a large head, say) cut to its first rows, at least MIN_ROWS of each part."""
    out: list[Call] = []
    left = budget
    for p in projections:
        if left <= 0:
            break
        if set(p.types) != {type_id}:
            continue
        rb = _row_bytes(type_id, p.in_features)
        parts = []
        for pt in p.parts:
            rows = max(min(pt.rows, left // rb), min(pt.rows, MIN_ROWS))
            if left > 0:
                parts.append(TqPart(pt.w, rows, pt.type))
                left -= rows * rb
        out.append(Call((TqPart * len(parts))(*parts), p.in_features, sum(q.rows for q in parts)))
    return out


def candidates(variants: Sequence[str], type_id: int, cls: str) -> tuple[str, ...]:
    """The kernels timed for `type_id` in `cls`: each variant, and for a dense type's decode
    each variant in the one-row form too (`library.kernel_name`)."""
    if cls != "decode" or type_id not in library.DENSE_TYPES:
        return tuple(variants)
    return tuple(library.kernel_name(v, f) for f in (0, 1) for v in variants)


def time_variants(
    projections: Sequence[Call],
    rows: int,
    threads: int,
    names: Sequence[str],
    dram: bool = False,
) -> dict[str, list[float]]:
    """{kernel: [seconds of its pass in each round]} over the sampled calls at `rows` rows of X,
    each kernel's build called directly (unrouted) in its form, passes interleaved (module
    docstring); `dram`: the sample evicted from the caches before every pass, untimed."""
    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((rows, k)).astype(np.float32) for k in
          {p.in_features for p in projections}}  # fmt: skip
    ys = [np.empty((rows, p.out_features), np.float32) for p in projections]
    calls = [
        (p.parts, len(p.parts), xs[p.in_features].ctypes.data, y.ctypes.data, p.in_features)
        for p, y in zip(projections, ys, strict=True)
    ]
    kernels = {n: library.split_kernel(n) for n in names}  # {name: (variant, form)}
    fns = {n: library.variant_library(v).tandem_qgemv for n, (v, _) in kernels.items()}
    evict = library.library().tandem_evict
    spans = [(pt.w, pt.rows * _row_bytes(pt.type, p.in_features))
             for p in projections for pt in p.parts]  # fmt: skip
    dense = {pt.type for p in projections for pt in p.parts} & library.DENSE_TYPES

    def one_pass(name: str) -> float:
        fn = fns[name]
        variant, form = kernels[name]
        for t in dense:  # unrouted() puts every build's forms back after the timing
            library.set_dense_form(variant, t, form)
        if dram:
            for w, nbytes in spans:
                evict(w, nbytes)
        t0 = time.perf_counter()
        for parts, n, x, y, k in calls:
            if fn(x, parts, n, None, y, rows, k, 0, threads) != 0:
                raise library.NativeError(f"the {name} build refused a projection of {k} columns")
        return time.perf_counter() - t0

    passes: dict[str, list[float]] = {n: [] for n in names}
    with library.unrouted():  # the primary's own kernels when it is timed, not a route's
        for n in names:
            one_pass(n)  # warm: pages touched, code and caches loaded
        for r in range(ROUNDS):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                passes[name].append(one_pass(name))
    return passes


def _machine_key() -> str:
    feats = library.features()
    src = library.source_hash(library._compiler() or "cc")
    return f"{cpu_isa.cpu_model()} | {','.join(cpu_isa.feature_names(feats))} | {src}"


def _sample_key(
    type_id: int, cls: str, threads: int, projections: Sequence[Call], dram: bool
) -> str:
    shapes = ",".join(f"{p.out_features}x{p.in_features}" for p in projections)
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:12]
    where = "dram" if dram else "cache"
    return f"{_name(type_id)} {cls} threads={threads} shapes={digest} from={where}"


def _load_cache() -> dict[str, Any]:
    try:
        return json.loads((library.cache_dir() / CHOICES_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _store_cache(doc: dict[str, Any]) -> None:
    path = library.cache_dir() / CHOICES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".choices-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a concurrent writer's whole file wins


_current: dict[str, Any] = {}


def current() -> dict[str, Any]:
    """What this process chose so far (`choose`'s report), {} before any choice."""
    return dict(_current)


def choose(
    projections: Sequence[Projection], threads: int, *, use_cache: bool = True
) -> dict[str, Any]:
    """Times, chooses and routes each weight type of `projections` (module docstring); returns
    the report `tandem generate --json` and `/v1/cluster` show:

        {"cpu": model, "features": [...], "primary": variant, "forced": variant | None,
         "llc_mib": last-level cache, "weights_mib": a token's weight read,
         "kernels": {type name: {class: {"variant": kernel, "ms": {kernel: median ms} | None,
                                         "dram": whether timed from DRAM,
                                         "vs_avx2": {kernel: median ratio} (timed only),
                                         "noisy": bool (timed only), "cached": bool}}}}
    """
    report: dict[str, Any] = {
        "cpu": cpu_isa.cpu_model(),
        "features": cpu_isa.feature_names(library.features()),
        "primary": library.primary(),
        "forced": library.forced(),
        "llc_mib": round(llc_bytes() / (1 << 20), 1),
        "weights_mib": round(weight_bytes(projections) / (1 << 20), 1),
        "kernels": {},
    }
    streams = decode_reads_dram(projections)
    variants = library.variants() if library.forced() is None else (library.forced(),)
    types = sorted({t for p in projections for t in p.types})
    doc = _load_cache() if use_cache else {}
    machine = doc.setdefault(_machine_key(), {})
    timed = False
    for t in types:
        per_class: dict[str, Any] = {}
        for cls, budget in (("decode", DECODE_SAMPLE_BYTES), ("prefill", PREFILL_SAMPLE_BYTES)):
            picked = sample(projections, t, budget)
            dram = streams and cls == "decode"
            names = candidates(variants, t, cls) if library.forced() is None else variants
            if len(names) == 1 or not picked:
                per_class[cls] = {"variant": names[0] if len(names) == 1 else library.primary(),
                                  "ms": None, "dram": dram, "cached": False}  # fmt: skip
                continue
            timed = True
            key = _sample_key(t, cls, threads, picked, dram)
            hit = machine.get(key)
            cached = hit is not None
            if hit is None:
                passes = time_variants(picked, ROWS[cls], threads, names, dram)
                ms = {n: round(statistics.median(ts) * 1e3, 4) for n, ts in passes.items()}
                vs = {n: round(r, 4) for n, r in relative(passes).items()}
                noisy = is_noisy(passes)
                hit = {"variant": BASELINE if noisy else decide(passes), "ms": ms, "vs_avx2": vs,
                       "noisy": noisy, "dram": dram}  # fmt: skip
                if not noisy:
                    machine[key] = hit
            per_class[cls] = {**hit, "cached": cached}
            library.route(t, cls, hit["variant"])
        report["kernels"][_name(t)] = per_class
    if use_cache and timed:
        _store_cache(doc)
    _current.clear()
    _current.update(report)
    return report
