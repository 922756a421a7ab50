"""The numerical conformance check a rank passes before it is admitted to a tensor-parallel group.

A broken vendor kernel (a wrong GEMM on one device, a dtype path that overflows) must not turn into
silent garbage tokens. So once every shard is loaded, the group runs one fixed probe through each
rank's own modules, kernels and compute dtype, and the head compares each rank's result with its
own float64 computation from the model file:

    x          (1, T, D) float32, the same seeded values on every rank
    rank r's   p_r = down_r( act(gate_r x) * up_r x )    over its MLP rows I_r = [a, b), act the
    partial    model's (`ACTIVATIONS`: SiLU, Gemma's GELU-tanh):
               gate_r = G[a:b], up_r = U[a:b] (column-parallel), down_r = Dn[:, a:b] (row-parallel)

The MLP's own forward ends in the row-parallel all-reduce, so the group runs it once per rank r
with every other rank feeding zeros: act(0) * 0 = 0 contributes nothing, and the sum is rank r's
partial (a baseline round with zeros everywhere is subtracted, so an MLP bias cancels too); each
rank's own view of its round is all-gathered in float32 to the head. The head reads rank r's rows from its own copy of the file (`ModelSource.read` slices, dequantized
for GGUF blocks) in chunks and computes p_r in float64. The error is relative, in the Frobenius
norm, `e_r = |y_r - p_r| / |p_r|`, against a tolerance derived from the rank's compute dtype
(`tolerance`). The verdict is broadcast; any rank outside its tolerance fails the group on every
rank with `ConformanceError`, naming the rank, its device and dtype, the error and the tolerance.

A sparse (mixture-of-experts) layer is probed through its experts without the router (whose top-k
could pick other experts in another dtype): each rank sends every probe token to two experts it
holds, the first and the last of its first group of experts (`TPPlan.expert_groups`, the module
`mlp.experts`), with weights PROBE_WEIGHTS, through its rows of them, and all-gathers that local
partial; the head computes the same from the file in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.comm.base import Communicator
from tandem.loaders.source import ModelSource
from tandem.models.moe import MoE, clamped_swiglu
from tandem.parallel.moe import holds_down_bias
from tandem.parallel.plan import TPPlan

PROBE_SEED = 0x7A4D
PROBE_TOKENS = 4
PROBE_WEIGHTS = (0.625, 0.375)  # the two probed experts' weights (exact in every dtype)
CHUNK_ROWS = 512  # the head's float64 reference reads a rank's MLP rows this many at a time
ACTIVATIONS = {  # ModelConfig.mlp_activation -> the gated MLP's activation
    "silu": F.silu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
}


class ConformanceError(RuntimeError):
    """A rank's kernels disagree with the head's float64 reference beyond its dtype's tolerance."""


@dataclass(frozen=True)
class RankVerdict:
    rank: int
    error: float  # relative Frobenius error of the rank's probe against float64
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


def tolerance(dtype: str, contraction: int, quantized: bool) -> float:
    """What an honest kernel can miss by, relative: the compute dtype's rounding of the input,
    weights and intermediates (a handful of unit roundoffs `u`), plus float32 accumulation over
    the longest contraction (`u_f32 sqrt(K)`, random-walk growth, with room), plus, for a GGUF
    rank, its kernels' int8 activation rounding (1/254 per element, llama.cpp's Q8 blocks)."""
    u = torch.finfo(getattr(torch, dtype)).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    tol = 12 * u + 8 * u32 * math.sqrt(contraction)
    if quantized:
        tol += 8 / 254
    return tol


def probe_input(hidden: int) -> torch.Tensor:
    """(1, T, D) float32 standard normal, identical on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn((1, PROBE_TOKENS, hidden), generator=g, dtype=torch.float32)


def run_probe(comm: Communicator, mlp: nn.Module, hidden: int) -> list[torch.Tensor]:
    """Every rank's partial of the probe as that rank computed it, in float32 on every rank: one
    round per rank with only that rank feeding `x`, minus a round of zeros; each rank keeps its
    own round's result (in its own dtype, as its all-reduce decoded it) and the group all-gathers
    those in float32, so no other rank's rounding enters a rank's figure. Collective: every rank
    calls it with its own shard's MLP. -> [(1, T, D) float32] * world_size"""
    p = next(mlp.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    x = probe_input(hidden)
    zero = torch.zeros_like(x)
    if isinstance(mlp, MoE):
        with torch.no_grad():
            own = _probe_experts(mlp.experts, x.to(device, dtype)).float().cpu()
        rows = comm.all_gather(own.contiguous(), 0)
        return [rows[r : r + 1] for r in range(comm.world_size)]
    with torch.no_grad():
        base = mlp(zero.to(device, dtype)).float().cpu()
        own = base
        for r in range(comm.world_size):
            y = mlp((x if comm.rank == r else zero).to(device, dtype)).float().cpu()
            if r == comm.rank:
                own = y - base
    rows = comm.all_gather(own.contiguous(), 0)  # (N, T, D): rank r's own result in row r
    return [rows[r : r + 1] for r in range(comm.world_size)]


def probed_experts(first: int, end: int) -> tuple[int, int]:
    """The two experts a rank holding experts `[first, end)` is probed through."""
    return first, end - 1


def _probe_experts(experts: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x (1, T, D) through the held experts `probed_experts` with PROBE_WEIGHTS -> (1, T, D)."""
    flat = x.reshape(-1, x.shape[-1])
    ids = torch.tensor(probed_experts(experts.first, experts.first + experts.count))
    ids = ids.expand(flat.shape[0], 2)
    w = torch.tensor(PROBE_WEIGHTS, dtype=x.dtype).expand(flat.shape[0], 2)
    return experts(flat, w, ids).view(x.shape)


def reference_experts(
    md: ModelSource,
    layer: int,
    experts: tuple[int, int],
    rows: tuple[int, int],
    x: torch.Tensor,
    down_bias: bool = True,
) -> torch.Tensor:
    """`_probe_experts` in float64 from the file: the two probed experts, rows `[a, b)`, with
    the spec's activation and biases (the down bias where this rank adds it, `down_bias`)."""
    a, b = rows
    spec = md.config.moe
    pre = f"model.layers.{layer}.mlp.experts."
    x64 = x.double()

    def bias(name: str, e: int, c0: int | None = None, c1: int | None = None) -> torch.Tensor:
        t = md.read(pre + name, 0, e, e + 1)[0]  # (out,) of expert e
        return (t if c0 is None else t[c0:c1]).double()

    y = torch.zeros((*x.shape[:-1], md.config.hidden_size), dtype=torch.float64)
    for e, w in zip(probed_experts(*experts), PROBE_WEIGHTS):
        for c0 in range(a, b, CHUNK_ROWS):
            c1 = min(b, c0 + CHUNK_ROWS)

            def part(name: str, dim: int, e: int = e, c0: int = c0, c1: int = c1) -> torch.Tensor:
                t = md.read(pre + name, 0, e, e + 1)[0]  # (out, in) of expert e
                return t.narrow(dim, c0, c1 - c0).double()

            g = F.linear(x64, part("gate_proj.weight", 0))
            u = F.linear(x64, part("up_proj.weight", 0))
            if spec.expert_bias:
                g, u = g + bias("gate_proj.bias", e, c0, c1), u + bias("up_proj.bias", e, c0, c1)
            if spec.activation == "swiglu_clamped":
                h = clamped_swiglu(g, u, spec.swiglu_alpha, spec.swiglu_limit)
            else:
                h = F.silu(g) * u
            y += w * F.linear(h, part("down_proj.weight", 1))
        if spec.expert_bias and down_bias:
            y += w * bias("down_proj.bias", e)
    return y


def reference_partial(
    md: ModelSource, layer: int, rows: tuple[int, int], x: torch.Tensor
) -> torch.Tensor:
    """p_r in float64 from the file: rows `[a, b)` of gate/up, the same columns of down."""
    a, b = rows
    pre = f"model.layers.{layer}.mlp."
    x64 = x.double()
    act = ACTIVATIONS[md.config.mlp_activation]
    y = torch.zeros((*x.shape[:-1], md.config.hidden_size), dtype=torch.float64)
    for c0 in range(a, b, CHUNK_ROWS):
        c1 = min(b, c0 + CHUNK_ROWS)
        g = F.linear(x64, md.read(pre + "gate_proj.weight", 0, c0, c1).double())
        u = F.linear(x64, md.read(pre + "up_proj.weight", 0, c0, c1).double())
        y += F.linear(act(g) * u, md.read(pre + "down_proj.weight", 1, c0, c1).double())
    return y


def judge(
    md: ModelSource, plan: TPPlan, dtypes: list[str], got: list[torch.Tensor], layer: int
) -> list[RankVerdict]:
    """The head's verdict on each rank's probe result (module docstring)."""
    x = probe_input(md.config.hidden_size)
    sparse = md.config.is_sparse(layer)
    pre = f"model.layers.{layer}.mlp.{'experts.' if sparse else ''}"
    quantized = any(
        getattr(md.info(f"{pre}{n}.weight"), "quantized", False)
        for n in ("gate_proj", "up_proj", "down_proj")
    )
    firsts = [g[0] for g in plan.expert_groups] if sparse else []
    widths = [g.rows for g in firsts] if sparse else plan.intermediate
    k = max(md.config.hidden_size, max(s.size for s in widths))
    verdicts = []
    for r, y in enumerate(got):
        s = widths[r]
        if sparse:
            e = firsts[r].experts
            span, own_bias = (e.start, e.end), holds_down_bias(firsts[r])
            ref = reference_experts(md, layer, span, (s.start, s.end), x, own_bias)
        else:
            ref = reference_partial(md, layer, (s.start, s.end), x)
        err = float((y.double() - ref).norm() / ref.norm().clamp_min(1e-300))
        verdicts.append(RankVerdict(r, err, tolerance(dtypes[r], k, quantized)))
    return verdicts


def check_conformance(
    comm: Communicator,
    model: nn.Module,
    *,
    md: ModelSource | None,
    plan: TPPlan | None,
    dtypes: list[str],
    devices: list[str],
    layer: int | None = None,
) -> list[RankVerdict]:
    """Collective: runs the probe on `layer` (default the model's first) of every rank's shard;
    rank 0 passes the open model source `md` and judges, then the verdicts go to every rank. Any
    rank outside its tolerance raises `ConformanceError` on every rank (the group does not form).
    Returns the verdicts (for reports)."""
    layers = model.model.layers
    layer = int(next(iter(layers.keys()))) if layer is None else layer
    hidden = model.config.hidden_size
    got = run_probe(comm, layers[str(layer)].mlp, hidden)
    n = comm.world_size
    table = torch.zeros((2, n), dtype=torch.float32)  # errors, tolerances (float32 on the wire)
    if comm.rank == 0:
        assert md is not None and plan is not None, "the head judges from its own model source"
        verdicts = judge(md, plan, dtypes, got, layer)
        table = torch.tensor(
            [[v.error for v in verdicts], [v.tolerance for v in verdicts]], dtype=torch.float32
        )
    table = comm.broadcast(table, 0)
    verdicts = [RankVerdict(r, float(table[0, r]), float(table[1, r])) for r in range(n)]
    bad = [v for v in verdicts if not v.ok]
    if bad:
        raise ConformanceError(
            "; ".join(
                f"rank {v.rank} ({devices[v.rank]}, {dtypes[v.rank]}) failed the numerical "
                f"conformance check: its layer-{layer} MLP shard on a seeded input is off the "
                f"head's float64 reference by {v.error:.3g} (relative), tolerance "
                f"{v.tolerance:.3g} for {dtypes[v.rank]}; the rank is refused (a broken kernel "
                f"or driver on that device?)"
                for v in bad
            )
        )
    return verdicts
