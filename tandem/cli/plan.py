"""`tandem plan`: predicted decode tok/s of every layout for given nodes and link, and the pick.

    tandem plan --preset qwen3-0.6b --node spark:168tok/s --node evo:168tok/s --link 2.5gbit
    tandem plan --model DIR --measure-local 2 --link 2.5gbit --node gpu:6ms

`--measure-local K` times a short decode run of the model here and adds K nodes at that speed that
share this machine; with K >= 2 it also runs the lockstep probe (`tandem.plan.lockstep`: what k
TP ranks on this machine lose per sync waiting for each other, k = 2..K) unless `--no-probe`.
`--node NAME:TIME[@HOST]` adds a node that is not here (TIME per token alone, e.g. 6ms or
168tok/s; no lockstep penalty unless `--lockstep HOST:K=TIME,...` gives its host one, e.g. from
that host's `tandem bench`). The model's figures come from `tandem.plan.model`.

`--from-cluster TOKEN` (a live cluster's status board) or `--from-status FILE` (the JSON of
`tandem cluster status --json`) takes the nodes and the link from the probes its ranks measured
as their group formed (`tandem.plan.probes`), instead of --node and --link.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from tandem.plan.experts import render_placement
from tandem.plan.model import (
    LinkSpec,
    NodeSpec,
    PlanModelError,
    Prediction,
    candidate_layouts,
    parse_duration,
    parse_lockstep,
    parse_node,
    parse_rate,
    rank_layouts,
)

# Software cost per message of our host-staged ring: calibrated by `tandem bench` on loopback on the
# 2-core build machine (BENCHMARKS.md: 132 us at load ~15; 271 us on the emulated link). Pass your
# own `--overhead` from `tandem bench` on your nodes.
DEFAULT_OVERHEAD = "130us"
PROBE_MAX_K = 4  # the lockstep probe's largest group (a few seconds per k)
DEFAULT_RTT = "100us"  # a direct 2.5 GbE cable between two PCs, kernel to kernel and back


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="predict decode tok/s for each TP/PP layout and pick one", description=__doc__
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="a model directory (config.json) or a GGUF file (shows its block-rounded TP shards)",
    )
    src.add_argument("--preset", help="a built-in model shape, e.g. qwen3-0.6b")
    p.add_argument("--node", action="append", default=[], help="NAME:TIME[@HOST], repeatable")
    p.add_argument(
        "--measure-local",
        type=int,
        default=0,
        metavar="K",
        help="time the model here and add K nodes at that speed on this machine",
    )
    p.add_argument(
        "--lockstep",
        action="append",
        default=[],
        metavar="HOST:K=TIME,...",
        help="a host's lockstep penalty per sync with K ranks on it, repeatable",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="with --measure-local: skip the lockstep probe (penalty 0 here)",
    )
    probed = p.add_mutually_exclusive_group()
    probed.add_argument(
        "--from-cluster", metavar="TOKEN", help="nodes and link from a live cluster's probes"
    )
    probed.add_argument(
        "--from-status", metavar="FILE", help="nodes and link from `cluster status --json` output"
    )
    p.add_argument("--link", default="2.5gbit", help="line rate (2.5gbit) or goodput (280MB/s)")
    p.add_argument("--rtt", default=DEFAULT_RTT, help="link round trip, e.g. 100us")
    p.add_argument(
        "--overhead",
        default=DEFAULT_OVERHEAD,
        help="software cost per message per rank (staging, framing, reduction)",
    )
    p.add_argument(
        "--moe", choices=("tp", "experts"), default="tp",
        help="a mixture of experts' placement, predicted and shown (as generate/serve --moe)",
    )  # fmt: skip
    p.add_argument("--max-tp", type=int, default=8)
    p.add_argument("--max-pp", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        config = _load_config(args)
        if args.from_cluster or args.from_status:
            return _run_from_probes(args, config)
        nodes = [parse_node(t) for t in args.node]
        if args.measure_local:
            from tandem.bench.harness import measure_local_s_per_token

            s = measure_local_s_per_token(config, model_dir=args.model)
            nodes = [
                NodeSpec(f"local{i}", s, host="local") for i in range(args.measure_local)
            ] + nodes
        if not nodes:
            raise PlanModelError("give at least one --node NAME:TIME or --measure-local K")
        link = LinkSpec(
            rtt_s=parse_duration(args.rtt),
            goodput_bytes_per_s=parse_rate(args.link),
            overhead_s=parse_duration(args.overhead),
        )
        penalties = dict(parse_lockstep(t) for t in args.lockstep)
        if args.measure_local >= 2 and not args.no_probe and "local" not in penalties:
            penalties["local"] = _probe_local(
                config, args.measure_local, nodes[0], link, args.model
            )
        nodes = [replace(n, lockstep_s=penalties.get(n.host, ())) if n.host else n for n in nodes]
        layouts = candidate_layouts(len(nodes), args.max_tp, args.max_pp)
        blocks = _file_blocks(args)
        preds = rank_layouts(config, nodes, link, layouts, args.moe, blocks)
        placement = _placement(args, config, preds, nodes, blocks)
    except PlanModelError as e:
        print(f"tandem plan: {e}", file=sys.stderr)
        return 2
    if not preds:
        print("tandem plan: no layout fits these nodes and this model", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"nodes": [asdict(n) for n in nodes], "link": asdict(link),
                          "predictions": [_row(p) for p in preds], "pick": preds[0].layout.name,
                          "experts": placement[0].entry() if placement else None},
                         indent=2))  # fmt: skip
        return 0
    print(render_table(preds, nodes, link))
    print(f"\npick: {preds[0].layout.name} ({preds[0].tok_per_s:.1f} tok/s predicted)")
    tp = preds[0].layout.tp
    if args.model and tp > 1:
        weights = _pick_weights(preds[0], nodes)
        print("\n" + render_shards(_shard_plan(args.model, tp, args.moe, weights)[1]))
    if placement:
        print("\n" + render_placement(config, *placement))
    return 0


def _pick_weights(pred: Prediction, nodes: list[NodeSpec]) -> tuple[float, ...] | None:
    """The first stage's TP weights of the picked layout: its nodes' speeds when weighted."""
    if not pred.layout.weighted:
        return None
    fastest = sorted(nodes, key=lambda n: n.s_per_token)[: pred.layout.tp]
    return tuple(1.0 / n.s_per_token for n in fastest)


def _file_blocks(args: argparse.Namespace) -> dict[str, int] | None:
    """The model file's contraction block sizes (`parallel.plan.contraction_blocks`, what the
    loader's `plan_for_source` plans with); None for a preset or a config.json without weights,
    which have no file."""
    if not args.model:
        return None
    from tandem.loaders.errors import MissingFileError
    from tandem.loaders.source import open_model
    from tandem.parallel.plan import contraction_blocks

    try:
        return contraction_blocks(open_model(args.model))
    except MissingFileError:
        return None


def _placement(
    args: argparse.Namespace,
    config,
    preds: list[Prediction],
    nodes: list[NodeSpec],
    blocks: dict[str, int] | None,
):
    """(the pick's expert placement, how its bytes are counted) for a mixture of experts; None
    for a dense model or no pick. A file's bytes are its tensors' block types; a preset, which
    has none, is counted in bfloat16."""
    from tandem.parallel.moe_reads import source_bytes, uniform_bytes
    from tandem.plan.experts import place_experts

    if getattr(config, "moe", None) is None or not preds:
        return None
    pick = preds[0]
    if args.model:
        from tandem.loaders.source import open_model

        nbytes, note = source_bytes(open_model(args.model)), "as stored"
    else:
        nbytes, note = uniform_bytes(2), "in bfloat16: a preset has no file"
    placed = place_experts(
        config, pick.layout, pick.stage_layers, nodes, args.moe, nbytes, blocks
    )  # fmt: skip
    return placed, note


def _snapshot(args: argparse.Namespace) -> dict:
    from tandem.plan.probes import load_snapshot

    if args.from_status:
        return load_snapshot(args.from_status)
    from tandem.cluster.status import StatusError, query
    from tandem.cluster.token import JoinTokenError, decode_token

    try:
        topo = decode_token(args.from_cluster)
        return query(topo.hosts[0], topo.status_port, topo.secret)
    except (JoinTokenError, StatusError) as e:
        raise PlanModelError(str(e)) from None


def _run_from_probes(args: argparse.Namespace, config) -> int:
    """The layouts of the probed ranks, ranked by predicted tok/s, the chosen one first."""
    from tandem.plan.probes import link_from_probes, nodes_from_probes, probe_rows, render_probes

    rows = probe_rows(_snapshot(args))
    nodes = nodes_from_probes(config, rows)
    link = link_from_probes(rows, parse_duration(args.overhead))
    blocks = _file_blocks(args)
    layouts = candidate_layouts(len(nodes), args.max_tp, args.max_pp)
    preds = rank_layouts(config, nodes, link, layouts, args.moe, blocks)
    if not preds:
        raise PlanModelError("no layout fits these ranks and this model")
    placement = _placement(args, config, preds, nodes, blocks)
    if args.json:
        print(json.dumps({"nodes": [asdict(n) for n in nodes], "link": asdict(link),
                          "predictions": [_row(p) for p in preds], "pick": preds[0].layout.name,
                          "experts": placement[0].entry() if placement else None},
                         indent=2))  # fmt: skip
        return 0
    print(render_probes(rows) + "\n")
    print(render_table(preds, nodes, link))
    print(f"\npick: {preds[0].layout.name} ({preds[0].tok_per_s:.1f} tok/s predicted)")
    if placement:
        print("\n" + render_placement(config, *placement))
    return 0


def _shard_plan(model: str, tp: int, moe: str = "tp", weights: tuple[float, ...] | None = None):
    """(the model source, its TP plan at `tp` ranks rounded to its weights' blocks)."""
    from tandem.loaders.source import open_model
    from tandem.parallel.plan import plan_for_source

    source = open_model(model)
    return source, plan_for_source(source, tp, weights, moe=moe)


def render_shards(plan) -> str:
    """Each rank's block-rounded shares, and o_proj's split (its fallback named when taken)."""
    n = plan.world_size
    lines = [
        f"tp={n} shards (o_proj contraction in blocks of {plan.o_block}, down_proj of "
        f"{plan.down_block}; MLP rows in blocks of {plan.mlp_align})"
    ]
    if plan.o_split == "gather":
        lines.append(
            "  o_proj: its q-head edges are not on its blocks -> fallback 'gather': all-gather "
            "the attention output, split o_proj's contraction on block-aligned columns"
        )
    else:
        lines.append("  o_proj: split on the ranks' q heads (edges on its blocks)")
    for r in range(n):
        kv, q, o = plan.kv_heads[r], plan.q_heads(r), plan.o_columns(r)
        mlp, voc = plan.intermediate[r], plan.vocab[r]
        lines.append(
            f"  rank {r}: kv heads [{kv.start}, {kv.end}) q heads [{q.start}, {q.end}) "
            f"o_proj cols [{o.start}, {o.end}) mlp rows [{mlp.start}, {mlp.end}) "
            f"vocab [{voc.start}, {voc.end})"
        )
    return "\n".join(lines)


def _probe_local(
    config, k: int, node: NodeSpec, link: LinkSpec, model: str | None
) -> tuple[tuple[int, float], ...]:
    """This machine's lockstep penalty per sync at 2..k ranks (at most `PROBE_MAX_K`; more ranks
    take its figure), its shards in the block types of `model`'s file where it is a GGUF one,
    against the plan's own terms for these nodes and this link."""
    from tandem.plan.lockstep import (
        LockstepProbeError,
        file_weight_types,
        link_penalties,
        measure_lockstep,
    )

    ks = tuple(range(2, min(k, PROBE_MAX_K) + 1))
    try:
        probe = measure_lockstep(config, ks=ks, types=file_weight_types(model))
    except LockstepProbeError as e:
        raise PlanModelError(str(e)) from None
    return link_penalties(probe, config, node.s_per_token, node.slots, link)


def _row(p: Prediction) -> dict:
    return {
        "layout": p.layout.name,
        "tok_per_s": p.tok_per_s,
        "ms_per_token": p.s_per_token * 1e3,
        "compute_ms": p.compute_s * 1e3,
        "sync_ms": p.sync_s * 1e3,
        "lockstep_ms": p.lockstep_s * 1e3,
        "wire_bytes_per_token": p.wire_bytes_per_token,
        "stage_layers": list(p.stage_layers),
        "tp_shares": [round(s, 4) for s in p.tp_shares],
    }


def render_table(preds: list[Prediction], nodes: list[NodeSpec], link: LinkSpec) -> str:
    hosts = {n.host: n.lockstep_s for n in nodes if n.host and n.lockstep_s}
    lock = "".join(
        f"lockstep per sync on {h}: "
        + ", ".join(f"{k} ranks {s * 1e3:.3f} ms" for k, s in pen)
        + "\n"
        for h, pen in hosts.items()
    )
    head = (
        f"nodes: {', '.join(f'{n.name} {n.s_per_token * 1e3:.2f} ms/token' for n in nodes)}\n"
        f"link: {link.goodput_bytes_per_s / 1e6:.0f} MB/s goodput, rtt {link.rtt_s * 1e6:.0f} us, "
        f"{link.overhead_s * 1e6:.0f} us per message\n{lock}\n"
        "| layout | tok/s | ms/token | compute ms | sync ms | lockstep ms | wire KB/token | "
        "stage layers |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {p.layout.name} | {p.tok_per_s:.1f} | {p.s_per_token * 1e3:.2f} | "
        f"{p.compute_s * 1e3:.2f} | {p.sync_s * 1e3:.2f} | {p.lockstep_s * 1e3:.2f} | "
        f"{p.wire_bytes_per_token / 1e3:.1f} | {'/'.join(map(str, p.stage_layers))} |"
        for p in preds
    ]
    return "\n".join([head, *rows])


def _load_config(args: argparse.Namespace):
    from tandem.config import ConfigError, ModelConfig
    from tandem.loaders.safetensors_dir import ModelFileError

    if args.model:
        from tandem.loaders.source import is_gguf, open_model

        try:
            if is_gguf(args.model):
                return open_model(args.model).config
            return ModelConfig.from_dir(args.model)
        except (ConfigError, ModelFileError) as e:
            raise PlanModelError(str(e)) from None
    from tandem.models.presets import UnknownPresetError, get_preset

    try:
        return get_preset(args.preset).config
    except UnknownPresetError as e:
        raise PlanModelError(str(e)) from None
