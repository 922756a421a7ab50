"""tandem: one large language model across the machines you own (CPUs and GPUs of any vendor),
over ordinary Ethernet, with tensor and pipeline parallelism and an OpenAI-compatible server.

The composition root: each command lives in its own module of this package; a command module
exposes `register(subparsers)`, which adds its parser and sets `func=run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# One module per command; a module listed here must exist.
COMMAND_MODULES: tuple[str, ...] = (
    "plan",
    "cluster",
    "serve",
    "make_model",
    "quantize",
    "launch",
    "generate",
    "worker",
    "bench",
    "stage",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"tandem.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
