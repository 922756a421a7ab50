"""tandem: one large language model across the machines you own (CPUs and GPUs of any vendor),
over ordinary Ethernet, with tensor and pipeline parallelism and an OpenAI-compatible server.

The composition root: each command lives in its own module of this package; a command module
exposes `register(subparsers)`, which adds its parser and sets `func=run`. A command line that
names a command imports that command's module only (so `tandem generate` imports no other
command's dependencies, torch among them, before it needs them); any other line (`--help`, a
typo) builds the whole parser.

The long-lived processes (`LONG_LIVED`: worker, stage, serve, launch) end with `os._exit` once their
command has returned and its cleanup has run, when started from the command line: the
interpreter's teardown cost each of them 0.35-0.9 s of CPU at every shutdown and did nothing
the kernel does not do at exit (`tandem.cli.exit_now`).
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

# Commands whose process ends with `exit_now` (no interpreter teardown) when run from the command line.
LONG_LIVED: frozenset[str] = frozenset({"worker", "stage", "serve", "launch"})


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
    """Runs the command `argv` names (default: the command line's). From the command line, a
    `LONG_LIVED` command's process ends here with its exit code (its return value, the code of
    a `sys.exit` inside it, or after the traceback of an uncaught exception 1, or
    `PEER_LOST_EXIT` when a heartbeat loss caused it) and no interpreter teardown; `main(argv)`
    called from Python returns or raises as before."""
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    command = command_named(argv)
    args = build_parser(command).parse_args(argv)
    if not (from_command_line and command in LONG_LIVED):
        return int(args.func(args) or 0)
    from tandem.cli.exit_now import exit_now

    try:
        code = int(args.func(args) or 0)
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it, exits 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        from tandem.cluster.exits import exit_code_for

        sys.excepthook(*sys.exc_info())  # the traceback Python would print, then its exit code
        code = exit_code_for(e)  # 1, or PEER_LOST_EXIT when a heartbeat loss ended it
    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
