"""tandem: one large language model across the machines you own (CPUs and GPUs of any vendor),
over ordinary Ethernet, with tensor and pipeline parallelism and an OpenAI-compatible server.

The composition root: each command lives in its own module of this package; a command module
exposes `register(subparsers)`, which adds its parser and sets `func=run`. A command line that
names a command imports that command's module only (so `tandem generate` imports no other
command's dependencies, torch among them, before it needs them); any other line (`--help`, a
typo) builds the whole parser.
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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of the command `only` alone."""
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__.split("\n\n")[0], epilog=models_supported()
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        if only is None or name == only:
            importlib.import_module(f"tandem.cli.{name}").register(sub)
    return parser


def models_supported() -> str:
    """The model list `tandem --help` ends with: the HF architectures and GGUF architectures."""
    from tandem.models import families

    hf = ", ".join(
        [*(f.architecture for f in families.FAMILIES)]
        + [f"{a} (its text model)" for f in families.FAMILIES for a in f.multimodal]
    )
    return (
        f"models (--model): HF directories of {hf} (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, "
        f"Mixtral, gpt-oss, Gemma 3, Phi-3 / Phi-4-mini, the Qwen3.5 / Qwen3.6 hybrid); GGUF "
        f"files of architecture "
        f"{', '.join(families.GGUF_ARCHITECTURES)}"
    )


def command_named(argv: list[str]) -> str | None:
    """The module of the command `argv` names (its first argument: the top-level parser takes no
    option but --help; "make-model" -> "make_model"), when it is one of COMMAND_MODULES."""
    module = argv[0].replace("-", "_") if argv else None
    return module if module in COMMAND_MODULES else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command_named(argv)).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
