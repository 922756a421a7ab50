"""`tandem serve`: an OpenAI-compatible server on the head, over one device or a TP / PP group.

    tandem serve --model DIR [--tp N --pp M] [--host 127.0.0.1 --port 8000] [--api-key-file F]

Binds 127.0.0.1 unless `--host` says otherwise, at once: while the cluster forms, the web page and
`/v1/cluster` say "forming" and the API answers 503. `/health` answers 200 while the cluster is whole.
With an API key, /v1 requires `Authorization: Bearer <key>`. Give the key in a file
(`--api-key-file`, its first line) or in the environment (TANDEM_API_KEY): `--api-key K` works
too, but puts the key on the command line, where `ps` shows it to every user of the machine.

Run from the command line, the process ends with `os._exit` once `run` has returned and its cleanup
has run (the HTTP server stopped, the engine and its ranks closed) (`tandem.cli.main.LONG_LIVED`):
the interpreter's teardown cost over a second of CPU at every shutdown and released nothing the
kernel does not.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tandem.cli.tp_args import ATTN_HELP, add_moe_argument
from tandem.cluster.launcher import LaunchError, check_port_free
from tandem.cluster.ring_config import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    check_heartbeat_timeout,
    load_ring_config,
)
from tandem.loaders.chat_template import TemplateLimits
from tandem.loaders.gguf.quantize_choices import QTYPES

DEFAULT_PORT = 8000
GRACEFUL_SHUTDOWN_S = 3


class ServeError(RuntimeError):
    """A mistake the user can fix (missing model, port in use, unsupported layout): one line."""


# how long a TP/PP group that lost a rank has to re-form before requests fail: serve, launch and
# a joined head alike
DEFAULT_REFORM_TIMEOUT_S = 120.0


REASONING_PARSERS = ("auto", "none", "think", "harmony")


def add_reasoning_argument(p: argparse.ArgumentParser) -> None:
    """`--reasoning-parser`, as `serve`, `launch` and a joined head (`cluster join`) take it."""
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSERS,
        help="how chat answers are split into reasoning and content: harmony (gpt-oss), think "
        "(<think>...</think>: Qwen3, DeepSeek-R1), none (the text as written); auto (default) "
        "picks by the tokenizer's marker tokens",
    )


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """A byte count: digits, optionally K, M or G (powers of 1024, a trailing B or iB allowed)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    digits = t[: len(t) - len(unit)]
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 512M, 2G, 1048576)")
    return int(digits) * _UNITS[unit]


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _positive_bytes(text: str) -> int:
    value = parse_bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive byte count")
    return value


_TEMPLATE = TemplateLimits()  # the documented defaults


def add_template_args(p: argparse.ArgumentParser) -> None:
    """The chat template's render bounds (`loaders.chat_template.TemplateLimits`): a render past
    one is answered 400 naming it; a template past one at the start's probe render is refused."""
    p.add_argument(
        "--template-time-limit",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help=f"wall seconds one chat-template render may take (default {_TEMPLATE.seconds:g})",
    )
    p.add_argument(
        "--template-output-limit",
        type=_positive_int,
        default=None,
        metavar="CHARS",
        help=f"characters a rendered chat prompt may have (default {_TEMPLATE.output_chars})",
    )
    p.add_argument(
        "--template-memory-limit",
        type=_positive_bytes,
        default=None,
        metavar="BYTES",
        help="address space of the process that renders the chat template (K, M, G: powers of "
        f"1024; Linux) (default {_TEMPLATE.memory_bytes >> 20}M)",
    )


def template_limits(args: argparse.Namespace) -> TemplateLimits:
    """The render bounds the flags give, each flag left out at its default."""
    given = {
        "seconds": args.template_time_limit,
        "output_chars": args.template_output_limit,
        "memory_bytes": args.template_memory_limit,
    }
    return TemplateLimits(**{k: v for k, v in given.items() if v is not None})


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `serve` and `launch`."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (local processes)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (local processes)")
    p.add_argument(
        "--pp-weights",
        default=None,
        help="a pipeline's layer proportions, e.g. 2,1, or auto: from each stage's GEMV speed and "
        "free memory, measured by its processes before loading (default: even by TP degree)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default 8000)")
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated names a request's Host may carry besides IP addresses, localhost "
        "and the bound name (DNS rebinding: other names get 421); * allows any",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="require the bearer key on this file's first line (or set TANDEM_API_KEY)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require this bearer key (visible in `ps`: prefer --api-key-file or TANDEM_API_KEY)",
    )
    p.add_argument(
        "--dtype", default="float32", help="compute dtype: one, or one per rank (a,b,...)"
    )
    p.add_argument("--device", default="cpu", help="device: one, or one per rank (a,b,...)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together per step")
    p.add_argument("--max-seq-len", type=int, default=None, help="context per sequence")
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a finished request's KV cache in its slot and let a later prompt that starts "
        "with the same tokens (the next turn of a chat) prefill only the rest; kept sequences "
        "fill idle slots of --max-batch only and go least recently used first (default: on)",
    )
    p.add_argument(
        "--cache-mem",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="bound the prefix cache: keep finished sequences holding at most BYTES of KV cache "
        "(K, M, G: powers of 1024) in blocks no running request holds, a block shared by "
        "sequences with a common prefix counted once (every layer, in the head's compute "
        "dtype), least recently used going first (default: as many as there are idle slots)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients use")
    add_template_args(p)
    add_reasoning_argument(p)
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=("auto", "hermes", "llama3", "mistral", "harmony"),
        help="the format the model writes tool calls in: hermes (<tool_call> blocks: Qwen, "
        "SmolLM2), llama3 (a bare JSON call), mistral ([TOOL_CALLS]), harmony (gpt-oss); auto "
        "(default) picks by the chat template",
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=None,
        help="seconds a local TP group's collective (a pipeline's step) may take before the rank "
        "it waits on counts as hung (default 60)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds a rank of a local TP group or pipeline may send no heartbeat before it counts as lost "
        "(hung, stopped, cut off) and the group re-forms without waiting for the op timeout; "
        f"heartbeats come from a thread that never waits for compute (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT_S:g}; 0: off)",
    )
    p.add_argument(
        "--reform-timeout",
        type=float,
        default=DEFAULT_REFORM_TIMEOUT_S,
        help="seconds a TP/PP group that lost a rank has to re-form (new local processes, or "
        "the joined worker's return; a new epoch; requests in flight are replayed) before "
        f"requests fail (default {DEFAULT_REFORM_TIMEOUT_S:g}, as under launch and cluster "
        "join); 0: a lost rank ends it",
    )
    p.add_argument(
        "--shrink-after",
        type=float,
        default=0.0,
        help="seconds a lost rank of a TP group has to come back before the group re-forms over "
        "one rank fewer (a joined pair: the head alone), within --reform-timeout; 0: never",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="a model directory or FILE.gguf (default: SmolLM2 GGUF if installed, else the built-in model)",
    )
    add_engine_args(p)
    p.add_argument("--attn-ranks", type=int, default=None, metavar="A", help=ATTN_HELP)
    add_moe_argument(p)
    p.add_argument(
        "--quantize",
        default=None,
        choices=sorted(QTYPES),
        help="quantize a safetensors model's matrices as it loads (one node; same kernels as GGUF)",
    )
    p.add_argument(
        "--ring-config",
        default=None,
        help="serve as rank 0 of a multi-machine TP group (RING_CONFIG file; workers run "
        "`tandem worker` or `tandem cluster join`)",
    )
    p.set_defaults(func=run)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The bearer key from --api-key-file, else --api-key, else TANDEM_API_KEY (None: no key)."""
    if args.api_key_file and args.api_key:
        raise ServeError("give --api-key-file or --api-key, not both")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ServeError(f"--api-key-file {args.api_key_file}: the first line is empty")
        return key
    return args.api_key or os.environ.get("TANDEM_API_KEY") or None


def run(args: argparse.Namespace) -> int:
    try:
        args.api_key = resolve_api_key(args)
        return _serve(args)
    except KeyboardInterrupt:
        return 130
    except (
        ServeError,
        LaunchError,
        RuntimeError,
        OSError,
        ValueError,
    ) as e:  # typed errors: one line
        print(f"tandem serve: error: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from tandem.cli.engine_factory import build_serving_engine
    from tandem.cluster.launcher import sigterm_as_keyboard_interrupt
    from tandem.loaders.source import is_gguf
    from tandem.server.app import create_app
    from tandem.server.forming import (
        AppSwitch,
        BackgroundServer,
        ServerStartError,
        create_forming_app,
    )
    from tandem.server.hosts import AllowedHosts

    if args.model is None:
        from tandem.builtin import default_model

        args.model = str(default_model()[0])
    model_dir = Path(args.model)
    if not ((model_dir / "config.json").is_file() or is_gguf(model_dir)):
        raise ServeError(f"{model_dir}: not a model directory (no config.json) or GGUF file")
    heartbeat_timeout = check_heartbeat_timeout(args.heartbeat_timeout, "--heartbeat-timeout")
    ring_config = Path(args.ring_config) if args.ring_config else None
    tp = load_ring_config(ring_config).world_size if ring_config else args.tp
    check_port_free(args.host, args.port)  # before minutes of weight loading, not after
    name = args.served_model_name or model_dir.resolve().name
    # The port answers at once: the page and /v1/cluster say "forming" until the engine is up.
    switch = AppSwitch(create_forming_app(name, tp=tp, pp=args.pp, api_key=args.api_key))
    allowed = AllowedHosts.for_bind(args.host, (args.allowed_hosts or "").split(","))
    http = BackgroundServer(switch, args.host, args.port, GRACEFUL_SHUTDOWN_S, allowed)
    close = None
    try:
        with sigterm_as_keyboard_interrupt():
            try:
                http.start()
            except ServerStartError as e:
                raise ServeError(str(e)) from e
            engine, close = build_serving_engine(
                model_dir,
                tp=args.tp,
                pp=args.pp,
                dtype=args.dtype,
                device=args.device,
                max_batch=args.max_batch,
                max_seq_len=args.max_seq_len,
                name=args.served_model_name,
                ring_config=ring_config,
                quantize=args.quantize,
                attn_ranks=args.attn_ranks,
                moe=args.moe,
                reform_timeout=args.reform_timeout,
                op_timeout=args.op_timeout,
                heartbeat_timeout=heartbeat_timeout,
                shrink_after=args.shrink_after,
                pp_weights=args.pp_weights,
                prefix_cache=args.prefix_cache,
                cache_mem=args.cache_mem,
                template_limits=template_limits(args),
            )
            switch.app = create_app(
                engine,
                api_key=args.api_key,
                reasoning=args.reasoning_parser,
                tool_parser=args.tool_call_parser,
            )
            layout = f"tp={args.tp}, pp={args.pp}"
            if ring_config:
                layout = f"rank 0 of the group in {ring_config}"
            base = f"http://{args.host}:{args.port}"
            print(f"tandem: serving {engine.model_name!r} ({layout}) on {base}/v1", flush=True)
            print(f"tandem: web page at {base}/", flush=True)
            http.wait()
    finally:
        http.stop()
        if close is not None:
            close()
    return 0
