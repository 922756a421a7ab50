"""`tandem bench`: one model, single node vs TP vs PP on loopback and an emulated 2.5 GbE link,
with HF transformers and torch gloo as peers in the same run; JSON, markdown and a PNG chart.

    tandem bench --preset qwen3-0.6b --layouts single,tp2,pp2,tp3,pp3 --out bench-out
    tandem bench --model FILE.gguf --layouts single,tp2,pp2 --passes 2 --out bench-gguf

A GGUF file runs in its own blocks on every rank (TP shards cut on block boundaries, PP stages
holding their layers' blocks, all on the quantized kernels); the HF transformers peer is
skipped for it.

The emulated link needs root and iproute2 (network namespaces, veth, `tc tbf`); without them use
`--links loopback`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="measure layouts side by side with peers", description=__doc__
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory or FILE.gguf")
    src.add_argument("--preset", help="make a random-weight model of this preset (cached in --out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="single,tp2,pp2,tp3,pp3")
    p.add_argument("--links", default="loopback,emulated")
    p.add_argument("--rate-mbit", type=int, default=2500, help="emulated link rate (tbf)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=32, help="decode tokens timed per run")
    p.add_argument("--rounds", type=int, default=2, help="timed generations per run; best kept")
    p.add_argument("--passes", type=int, default=1,
                   help="runs of every layout per link, interleaved over the layouts; best kept "
                        "(a burst of load then spoils one pass, not one layout)")  # fmt: skip
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2, help="threads for the whole machine")
    p.add_argument("--no-collectives", action="store_true", help="skip ring/gloo all-reduce")
    p.add_argument(
        "--no-probes",
        action="store_true",
        help="skip the lockstep probe and the concurrent-decode measurement (the TP "
        "predictions then take no lockstep penalty and the cores as slots)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--out", default="bench-out", help="directory for bench.{json,md,png} and logs")
    src.add_argument("--reanalyze", default=None, metavar="BENCH_JSON",
                     help="measure nothing: re-derive the report (sync split, plan check, "
                          "projection) of a saved bench.json into --out")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.bench.harness import BenchOptions, describe_model, parse_layouts, run_bench
    from tandem.bench.netns import NetnsUnavailable
    from tandem.bench.report import analyze

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.reanalyze:
        try:
            doc = json.loads(Path(args.reanalyze).read_text())
        except (OSError, ValueError) as e:
            print(f"tandem bench: --reanalyze {args.reanalyze}: {e}", file=sys.stderr)
            return 2
        return _write(analyze(doc), out)
    try:
        layouts = parse_layouts(args.layouts)
        links = tuple(x.strip() for x in args.links.split(",") if x.strip())
        if not links or set(links) - {"loopback", "emulated"}:
            raise ValueError(f"--links {args.links!r}: choose from loopback, emulated")
        if args.passes < 1 or args.rounds < 1:
            raise ValueError(
                f"--passes and --rounds must be >= 1, got {args.passes}, {args.rounds}"
            )
        model_dir = args.model or _make_preset(args.preset, args.seed, out)
        describe_model(str(model_dir))  # a path that is no model fails here, before any rank
    except ValueError as e:
        print(f"tandem bench: {e}", file=sys.stderr)
        return 2
    opts = BenchOptions(model_dir=str(model_dir), layouts=layouts, links=links,
                        rate_mbit=args.rate_mbit, prompt_len=args.prompt_len, decode=args.decode,
                        rounds=args.rounds, passes=args.passes,
                        dtype=args.dtype, threads=args.threads,
                        collectives=not args.no_collectives, probes=not args.no_probes,
                        hf_peer=not args.no_hf,
                        log_dir=str(out / "logs"))  # fmt: skip
    try:
        doc = run_bench(opts, log=lambda s: print(s, file=sys.stderr, flush=True))
    except NetnsUnavailable as e:
        print(f"tandem bench: {e}; or run with --links loopback", file=sys.stderr)
        return 2
    doc["command"] = " ".join(["tandem", *sys.argv[1:]])
    return _write(analyze(doc), out)


def _write(doc: dict, out: Path) -> int:
    from tandem.bench.report import chart, markdown

    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    md = markdown(doc)
    (out / "bench.md").write_text(md)
    if not chart(doc, str(out / "bench.png")):
        print("tandem bench: matplotlib not installed, no chart", file=sys.stderr)
    print(md)
    return 0


def _make_preset(preset: str, seed: int, out: Path) -> Path:
    from tandem.loaders.make import make_model_dir
    from tandem.models.presets import UnknownPresetError

    model_dir = out / f"model-{preset}-seed{seed}"
    if not (model_dir / "config.json").exists():
        try:
            make_model_dir(model_dir, preset, seed=seed)
        except UnknownPresetError as e:
            raise ValueError(str(e)) from None
    return model_dir
