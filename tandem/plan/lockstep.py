"""Per-host lockstep probe: what k TP ranks sharing this machine pay per sync beyond the plan.

A TP rank's decode step is a chain of (compute segment, small all-reduce) pairs: its shard of a
layer's attention, all-reduce of one hidden state (4 D bytes), its shard of the MLP, all-reduce,
2 L + 3 syncs per token. `plan_model` predicts one such (segment, all-reduce) on k co-located
ranks from the node's measured speed s (alone on the whole model) as

    t_model(k) = max_r, host ( f_r t_half,  sum_r f_r t_half / slots ) + a(k),
    t_half = s c / (2 R)                         (its `group_time`, `layer_shares`, `allreduce_s`)

What it leaves out, TP only: lockstep waiting (a rank woken by its peer's data may wait for a core
when the host runs more ranks than cores; the segments do not start together; the slowest rank
sets every sync's pace) and the work every rank repeats whatever k is (norms, RoPE, attention
over the cache, op dispatch; the model divides all of s by k). The probe measures both at once:
k real processes on this host, joined by tandem's ring over loopback, each looping over its real
`parallel.plan` shard of decoder layers (random weights, in the file's block types where the
model is a GGUF file (`weight_types`: each projection as the file's first layer stores it, so a
Q4_K_M file's shards multiply Q4_K and Q6_K blocks as its ranks will) else float32; the decode
kernels, a KV cache, one token at position `POSITION`, 1 thread; enough layers to stream more
than the caches hold):

    a = attn_r(norm(x)); all_reduce(a);  m = mlp_r(norm(x + a)); all_reduce(m)

and the penalty per sync is  p(k) = t_iter(k) / 2 - t_model(k)  (`penalties`, >= 0), with the
caller's node speed, slots and link: the plan's own terms. For reference it also times rank 0's
shard alone in its own process (`alone_s`) and the k ranks without the all-reduces (`free_s`).
Every figure is per sync, the median over blocks of one token's layers (as a decode step's is),
the best of `rounds` rounds (the least disturbed on a shared machine, as the bench keeps the best
round of each layout).

    python -m tandem.plan.lockstep --config FILE --world K --rank R --peers A:P,...  (one rank)
        [--weight-types '{"mlp.down_proj": 14, ...}']
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.cluster.launcher import free_ports
from tandem.config import INT_RANGES

POOL_MB = 128  # per rank: > this machine's 32 MB L3, so every layer streams from memory
POSITION = 40  # the decode position (a 32-token prompt, mid-generation)
DEFAULT_BLOCKS = 6  # per round, each one token's layers
DEFAULT_ROUNDS = 3


class LockstepProbeError(RuntimeError):
    """A probe rank failed or the probe was asked for something it cannot run."""


def syncs_per_token(config: Any) -> int:
    """Collectives per decode token on a TP head stage: 2 per layer, the embedding all-reduce,
    the control broadcast and the greedy argmax's all-reduce."""
    return 2 * config.num_hidden_layers + 3


def model_sync_s(config: Any, k: int, s_node: float, slots: float, sync_s: float) -> float:
    """The plan's time for one (half-layer segment, all-reduce) of k ranks on one host of
    `slots`, each node `s_node` alone on the whole model (`plan_model`'s terms)."""
    from tandem.parallel.partition import model_cost
    from tandem.plan.model import NodeSpec, group_time, layer_shares

    cost = model_cost(config)
    t_half = s_node * cost.layer_params / (cost.num_layers * cost.layer_params
                                           + cost.head_compute_params) / 2  # fmt: skip
    host = [NodeSpec(f"r{i}", s_node, host="here", slots=slots) for i in range(k)]
    return group_time([f * t_half for f in layer_shares(config, k, None)], host) + sync_s


def penalty_s(t_sync: float, model_s: float) -> float:
    """p(k): the probe's measured seconds per sync minus the plan's (`model_sync_s`), >= 0."""
    return max(0.0, t_sync - model_s)


def penalties(probe: dict, config: Any, s_node: float, slots: float, sync_s) -> dict[int, float]:
    """k -> p(k) from `measure_lockstep`'s figures; `sync_s(k)` is the plan's all-reduce time
    of one hidden state over k ranks on this host's link."""
    return {int(k): penalty_s(f["lockstep_s"],
                              model_sync_s(config, int(k), s_node, slots, sync_s(int(k))))
            for k, f in probe["by_k"].items()}  # fmt: skip


def link_penalties(
    probe: dict, config: Any, s_node: float, slots: float, link: Any
) -> tuple[tuple[int, float], ...]:
    """`penalties` against `link`'s (a `plan_model.LinkSpec`) all-reduce of one hidden state, as
    `NodeSpec.lockstep_s` holds them: (k, seconds per sync), by k."""
    from tandem.plan.model import allreduce_s

    hidden = 4 * config.hidden_size
    pen = penalties(probe, config, s_node, slots, lambda k: allreduce_s(link, k, hidden))
    return tuple(sorted(pen.items()))


# ---- one rank ---------------------------------------------------------------------------------


def weight_types(source: Any) -> dict[str, int]:
    """{a decoder layer's projection (`self_attn.q_proj`, `mlp.down_proj`,
    `linear_attn.out_proj`, ...): the ggml type id a GGUF `source` (`loaders.source.open_model`)
    stores it in}, from the first layer that has it; {} for a safetensors model. Projections in
    float32, a type the native kernels lack, or stacked experts are left out (the probe keeps
    them float32)."""
    from tandem.kernels.library import KERNEL_TYPES
    from tandem.models.quant.blocks import BY_NAME

    out: dict[str, int] = {}
    for name, info in getattr(source, "manifest", {}).items():
        m = re.fullmatch(r"model\.layers\.\d+\.(.+)\.weight", name)
        t = getattr(info, "type_id", None)
        if (
            m
            and m.group(1) not in out
            and len(getattr(info, "shape", ())) == 2
            and (t in KERNEL_TYPES and t != BY_NAME["F32"].type_id)
        ):
            out[m.group(1)] = t
    return out


def file_weight_types(model: str | Path | None) -> dict[str, int]:
    """`weight_types` of the model at path `model`: {} where it is not a GGUF file (or None)."""
    if not model:
        return {}
    from tandem.loaders.source import is_gguf, open_model

    return weight_types(open_model(model)) if is_gguf(model) else {}


def _bytes_per_param(types: dict[str, int]) -> float:
    """A layer's mean bytes per weight in `types` (4 for a float32 probe): what sizes its pool."""
    from tandem.models.quant.blocks import layout

    if not types:
        return 4.0
    return statistics.mean(layout(t).block_bytes / layout(t).block_size for t in types.values())


def shard_config(config: Any, k: int, rank: int, pool_mb: int, bytes_per_param: float = 4.0) -> Any:
    """Rank `rank` of k's slice of `config` (its q heads, kv heads and MLP rows under
    `parallel.plan`; a hybrid's DeltaNet q/k and v heads too), with as many layers as stream
    `pool_mb` MB at `bytes_per_param` (2 at least, and no more than a config may state: a tiny
    model streams less): the model's first n, a hybrid's DeltaNet ones among them."""
    from tandem.parallel.partition import model_cost

    heads, kv, ff = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    net = getattr(config, "deltanet", None)
    hk, hv = (net.num_key_heads, net.num_value_heads) if net is not None else (0, 0)
    if k > 1:
        from tandem.parallel.plan import plan_for_config

        plan = plan_for_config(config, k, None)
        heads = plan.q_rows(rank).size // config.head_dim
        kv = plan.kv_rows(rank).size // config.head_dim
        ff = plan.intermediate[rank].size
        if net is not None:
            hk, hv = plan.linear_k_heads[rank].size, plan.linear_v_heads(rank).size
    n = max(2, math.ceil(pool_mb * 2**20 * k / (bytes_per_param * model_cost(config).layer_params)))
    n = min(n, INT_RANGES["num_hidden_layers"][1])
    changes = dict(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ff,
                   num_hidden_layers=n)  # fmt: skip
    if net is not None:
        layers = tuple(i for i in net.linear_layers if i < n)
        changes["deltanet"] = dataclasses.replace(
            net, linear_layers=layers, num_key_heads=hk, num_value_heads=hv
        )
    return dataclasses.replace(config, **changes)


def _quantize_linears(model: Any, types: dict[str, int]) -> None:
    """Each decoder layer's projection named in `types` becomes a `QuantLinear` of random blocks
    of that type (where its width is a multiple of the type's block; else it stays float32).
    The blocks of one shape are quantized once, 16 rows of them, tiled to the full height and
    copied per layer (the timing does not depend on the values; each layer streams its own)."""
    import numpy as np
    from torch import nn

    from tandem.models.quant.blocks import layout
    from tandem.models.quant.linear import QuantLinear
    from tandem.models.quant.quantize import quantize

    rng, made = np.random.default_rng(0), {}
    for layer in model.model.layers.values():
        for role, t in types.items():
            path, _, attr = role.rpartition(".")
            try:
                parent = layer.get_submodule(path)
            except AttributeError:
                continue
            lin = getattr(parent, attr, None)
            if not isinstance(lin, nn.Linear) or lin.in_features % layout(t).block_size:
                continue
            key = (t, lin.out_features, lin.in_features)
            if key not in made:
                rows = (rng.standard_normal((16, lin.in_features)) * 0.02).astype(np.float32)
                q = quantize(rows, t)
                made[key] = np.resize(q, (lin.out_features, q.shape[1]))
            blocks = torch.from_numpy(made[key].copy())
            bias = None if lin.bias is None else lin.bias.detach().clone()
            setattr(parent, attr, QuantLinear(t, lin.in_features, lin.out_features, blocks, bias))


def _layers(shard: Any, types: dict[str, int] | None = None):
    """The shard's decoder layers on the decode kernels (its projections in `types`' block
    types, `_quantize_linears`), and a one-token decode step's context."""
    from tandem.kernels.prepare import prepare
    from tandem.models.kv_cache import KVCache
    from tandem.models.llama import Transformer

    model = Transformer(shard, with_embed=False, with_head=False).eval().requires_grad_(False)
    _quantize_linears(model, types or {})
    prepare(model, fuse=False)  # the TP layers' kernel, unfused as they are
    cache = KVCache.for_model(model, n_slots=1, max_seq_len=POSITION + 8)
    ctx = model.context([POSITION], [1], cache=cache, slots=[0])
    return list(model.model.layers.values()), ctx


def _step(layers: list, ctx, x: torch.Tensor, reduce):
    """Iteration i: layer i's attention shard (a hybrid's DeltaNet layer: its mixer), reduce,
    its MLP shard, reduce; x (1, D)."""

    def step(i: int) -> None:
        layer = layers[i % len(layers)]
        mixer = layer.mixer if hasattr(layer, "mixer") else layer.self_attn
        a = reduce(mixer(layer.input_layernorm(x), ctx))  # (1, D)
        reduce(layer.mlp(layer.post_attention_layernorm(x + a)))

    return step


def _per_sync(step, n_blocks: int, block: int) -> float:
    """Median over blocks of seconds per sync (2 per iteration), after one warm-up block."""
    i, per = 0, []
    for b in range(n_blocks + 1):
        t0 = time.perf_counter()
        for _ in range(block):
            step(i)
            i += 1
        if b:
            per.append((time.perf_counter() - t0) / (2 * block))
    return statistics.median(per)


def run_rank(args: argparse.Namespace) -> dict:
    """World 1: rank 0's shard of each `--alone-k` alone. World k: free-running, then lockstep."""
    from tandem.config import ModelConfig

    torch.set_num_threads(1)
    torch.manual_seed(args.rank)
    config = ModelConfig.from_hf_dict(json.loads(Path(args.config).read_text()))
    types = {role: int(t) for role, t in json.loads(args.weight_types).items()}
    per = _bytes_per_param(types)
    block = config.num_hidden_layers  # one token's layers
    x = torch.randn(1, config.hidden_size)
    with torch.inference_mode():
        if args.world == 1:
            alone = {}
            for k in (int(v) for v in args.alone_k.split(",")):
                layers, ctx = _layers(shard_config(config, k, 0, args.pool_mb, per), types)
                step = _step(layers, ctx, x, lambda t: t)
                alone[str(k)] = min(_per_sync(step, args.blocks, block) for _ in range(args.rounds))
                del layers, ctx, step
            return {"world": 1, "alone_s": alone}
        from tandem.comm.peers import connect_ring

        layers, ctx = _layers(shard_config(config, args.world, args.rank, args.pool_mb, per), types)
        comm = connect_ring(args.rank, args.world, args.peers.split(","), args.secret)
        try:
            comm.barrier()
            free = _per_sync(_step(layers, ctx, x, lambda t: t), args.blocks, block)
            step = _step(layers, ctx, x, comm.all_reduce_sum)
            rounds = []
            for _ in range(args.rounds):  # the least disturbed, as the bench keeps the best round
                comm.barrier()
                rounds.append(_per_sync(step, args.blocks, block))
            row = torch.zeros(args.world)
            row[args.rank] = free
            frees = comm.all_reduce_sum(row)  # every rank's free-running figure (x + 0 = x)
        finally:
            comm.close()
    return {"world": args.world, "free_s": float(frees.max()), "lockstep_s": min(rounds),
            "rounds_lockstep_s": rounds}  # fmt: skip


# ---- the probe --------------------------------------------------------------------------------


def _run_ranks(argvs: list[list[str]], timeout_s: float, hosts: Any = None) -> dict:
    """Rank i's argv on host i of `hosts` (a `bench.hosts.Hosts`), or here without it."""
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [hosts.popen(i, a, **pipes) if hosts is not None else subprocess.Popen(a, **pipes)
             for i, a in enumerate(argvs)]  # fmt: skip
    try:
        out, err = procs[0].communicate(timeout=timeout_s)
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        raise LockstepProbeError(f"lockstep probe rank failed: {err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])


def measure_lockstep(
    config: Any,
    ks: tuple[int, ...] = (2, 3),
    blocks: int = DEFAULT_BLOCKS,
    rounds: int = DEFAULT_ROUNDS,
    pool_mb: int = POOL_MB,
    timeout_s: float = 300.0,
    hosts: Any = None,
    link: str = "loopback",
    types: dict[str, int] | None = None,
) -> dict:
    """Per k, seconds per sync: `lockstep_s` (k ranks in lockstep), `free_s` (the same k ranks
    without the all-reduces, the slowest rank), `alone_s` (rank 0's shard alone). `config` is a
    `ModelConfig`; `types` the file's block type per projection (`weight_types`; None: float32);
    turn the figures into penalties with `penalties`. With `hosts` (a
    `bench.hosts.Hosts`, `link` its name in the bench) rank i runs on host i and the ranks talk
    over that link, as the layouts they stand for do; without it, over loopback here."""
    ks = tuple(sorted({k for k in ks if k >= 2}))
    if not ks:
        raise LockstepProbeError("the lockstep probe needs some k >= 2")
    from tandem.models.quant.blocks import layout

    with tempfile.TemporaryDirectory(prefix="tandem-lockstep-") as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(config.to_hf_dict()))
        base = [sys.executable, "-m", "tandem.plan.lockstep", "--config", str(cfg),
                "--blocks", str(blocks), "--rounds", str(rounds),
                "--pool-mb", str(pool_mb), "--weight-types", json.dumps(types or {})]  # fmt: skip
        alone = _run_ranks([[*base, "--alone-k", ",".join(map(str, ks))]], timeout_s, hosts)
        alone = alone["alone_s"]
        out: dict = {"position": POSITION, "pool_mb": pool_mb, "link": link, "by_k": {},
                     "weight_types": {r: layout(t).name for r, t in (types or {}).items()}}  # fmt: skip
        address = hosts.address if hosts is not None else (lambda i: "127.0.0.1")
        for k in ks:
            peers = ",".join(f"{address(i)}:{p}" for i, p in enumerate(free_ports(k)))
            argv = [*base, "--world", str(k), "--peers", peers, "--secret", secrets.token_hex(16)]
            r = _run_ranks([[*argv, "--rank", str(i)] for i in range(k)], timeout_s, hosts)
            out["by_k"][str(k)] = {"alone_s": alone[str(k)], "free_s": r["free_s"],
                                   "lockstep_s": r["lockstep_s"],
                                   "rounds_lockstep_s": r["rounds_lockstep_s"]}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.plan.lockstep")
    p.add_argument("--config", required=True, help="an HF config.json of the model")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--peers", default="", help="every rank's ADDR:PORT, in rank order")
    p.add_argument("--secret", default="")
    p.add_argument("--alone-k", default="2", help="world 1: time rank 0's shard of each k alone")
    p.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="timed rounds; best kept")
    p.add_argument("--pool-mb", type=int, default=POOL_MB)
    p.add_argument("--weight-types", default="{}", help="JSON {projection: ggml type id}")
    args = p.parse_args(argv)
    out = run_rank(args)
    if args.rank == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
