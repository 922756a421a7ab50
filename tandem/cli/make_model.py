"""`tandem make-model OUT --preset NAME [--seed S]`: a random-weight model directory in the exact
Hugging Face layout (config.json + safetensors [+ tokenizer]), deterministic for a seed."""

from __future__ import annotations

import argparse

from tandem.devices import COMPUTE_DTYPES, dtype_names
from tandem.loaders.make import make_model_dir
from tandem.models.presets import PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-weight model directory from a preset")
    p.add_argument("out", help="directory to write")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=sorted(COMPUTE_DTYPES), help="stored dtype (default: the preset's)"
    )
    p.add_argument(
        "--shard-mb", type=float, help="split weights into shards of about this many MiB"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    shard = int(args.shard_mb * 2**20) if args.shard_mb else None
    cfg = make_model_dir(
        args.out, args.preset, args.seed, dtype_names()[args.dtype] if args.dtype else None, shard
    )
    print(
        f"wrote {args.out}: {cfg.architecture}, {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.torch_dtype}"
    )
    return 0
