"""`tandem launch`: a whole local cluster in one command, serving the OpenAI API.

    tandem launch [--model DIR] [--tp 2 --pp 1] [--port 8000] [--no-demo]

Brings up the head (`tandem serve`) and its ranks as local processes on loopback for the model (the
built-in model when none is given), waits until the cluster is whole, streams one demo completion
(the model continuing a prompt), then serves until Ctrl-C. A TP or PP rank that dies is started
again by the head, which re-forms the group under a new epoch and replays the requests in flight
(`--reform-timeout`, `tandem.engine.recovery`); while it does, /health is 503 "re-forming ...".
Ctrl-C, SIGTERM, a head that exits or a cluster that cannot re-form (/health 503 for any other
reason) shut every process down: none is left behind and every port is freed.

Run from the command line, the process ends with `os._exit` once `run` has returned and its cleanup
has run (every process of the group ended; launch imports neither numpy nor torch)
(`tandem.cli.main.LONG_LIVED`): the interpreter's teardown cost over a second of CPU at every
shutdown and released nothing the kernel does not.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tandem.cli.serve import ServeError, add_engine_args, resolve_api_key
from tandem.cluster.launcher import (
    LaunchError,
    ProcessGroup,
    RankProcess,
    check_port_free,
    exit_cause,
    sigterm_as_keyboard_interrupt,
)
from tandem.engine.group_state import REFORMING

DEFAULT_DEMO_PROMPT = "Once upon a time"
FALLBACK_PRESET = "tiny-qwen3"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch",
        help="a local multi-process cluster + OpenAI server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="model directory or FILE.gguf (default: SmolLM2 GGUF if installed, else the built-in model)",
    )
    add_engine_args(p)
    p.add_argument("--no-demo", action="store_true", help="skip the demo completion")
    p.add_argument("--demo-prompt", default=None, help="text the demo completion continues")
    p.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for ranks to come up"
    )
    p.add_argument(
        "--log-dir", default=None, help="write each rank's output here instead of the terminal"
    )
    # a cluster by default: two ranks on loopback (re-formed when one of them dies: serve's
    # --reform-timeout default)
    p.set_defaults(func=run, tp=2)


def default_model_dir(console: Console) -> tuple[Path, str]:
    """(model path, demo prompt): SmolLM2's GGUF or the built-in model (`builtin.default_model`)
    if this install has one, else a small random preset made once and cached (so the command
    still shows the machinery working)."""
    from tandem.builtin import BuiltinModelMissingError, default_model

    try:
        return default_model()
    except BuiltinModelMissingError as e:
        console.print(f"[yellow]{e}[/yellow]")
    cache = Path.home() / ".cache" / "tandem" / "models" / FALLBACK_PRESET
    if not (cache / "config.json").is_file():
        console.print(f"[yellow]making a random-weight {FALLBACK_PRESET} model instead[/yellow]")
        out = subprocess.run(
            [sys.executable, "-m", "tandem", "make-model", str(cache)]
            + ["--preset", FALLBACK_PRESET, "--seed", "0"],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            tail = out.stderr.strip().splitlines()[-1:]
            raise LaunchError(f"could not make the fallback model: {tail}")
    return cache, DEFAULT_DEMO_PROMPT


def _get(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read() or b"{}")
        except (OSError, ValueError):
            body = {}
        return e.code, body if isinstance(body, dict) else {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    # Ctrl-C is how a launch is stopped, even when this process inherited SIGINT ignored (started
    # in the background by a non-interactive shell, which ignores it for its background jobs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        args.api_key = resolve_api_key(args)
        with sigterm_as_keyboard_interrupt():
            return _launch(args, console)
    except (LaunchError, ServeError) as e:
        print(f"tandem launch: error: {e}", file=sys.stderr)
        return 2


def serve_argv(args: argparse.Namespace, model: Path) -> list[str]:
    """The `tandem serve` command line `launch` runs: its engine flags passed on as given."""
    argv = [sys.executable, "-m", "tandem", "serve", "--model", str(model)]
    for flag in (
        "tp",
        "pp",
        "host",
        "port",
        "dtype",
        "device",
        "max_batch",
        "max_seq_len",
        "served_model_name",
        "reform_timeout",
        "op_timeout",
        "heartbeat_timeout",
        "shrink_after",
        "pp_weights",
        "cache_mem",
        "template_time_limit",
        "template_output_limit",
        "template_memory_limit",
        "allowed_hosts",
        "reasoning_parser",
        "tool_call_parser",
    ):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    if not args.prefix_cache:
        argv.append("--no-prefix-cache")
    return argv


def _launch(args: argparse.Namespace, console: Console) -> int:
    if args.model:
        model, demo_prompt = Path(args.model), DEFAULT_DEMO_PROMPT
    else:
        model, demo_prompt = default_model_dir(console)
    demo_prompt = args.demo_prompt or demo_prompt
    from tandem.loaders.source import is_gguf

    if not is_gguf(model) and not (model / "config.json").is_file():
        raise LaunchError(f"{model}: not a model directory (no config.json) or GGUF file")
    check_port_free(args.host, args.port)
    argv = serve_argv(args, model)
    n_ranks = args.tp * args.pp
    env = {"TANDEM_API_KEY": args.api_key} if args.api_key else {}  # not on argv, where ps shows it
    group = ProcessGroup(
        [RankProcess("head", argv, env)], log_dir=Path(args.log_dir) if args.log_dir else None
    )
    base = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}"
    try:
        group.start()
        gone = _wait_whole(console, group, base, n_ranks, args.startup_timeout)
        if gone is not None:
            raise LaunchError(
                f"{gone[0]} exited with {exit_cause(gone[1])} before the cluster was up"
            )
        _, models = _get(f"{base}/v1/models")
        name = models.get("data", [{}])[0].get("id", "?")
        console.print(
            f"[green]tandem:[/green] {n_ranks} rank(s) up (tp={args.tp}, pp={args.pp}); model [bold]{name}[/bold]"
        )
        console.print(
            f"OpenAI API at [bold]{base}/v1[/bold]  (health {base}/health, metrics {base}/metrics)"
        )
        console.print(f"web page (chat, cluster view) at [bold]{base}/[/bold]")
        if not args.no_demo:
            _demo(console, base, name, demo_prompt, args.api_key)
        console.print("serving; Ctrl-C to stop every rank")
        why: list[str] = []
        gone = group.wait(until=lambda: _down_for_good(base, why), interval_s=1.0)
        if gone is not None:
            console.print(
                f"[red]{gone[0]} exited with {exit_cause(gone[1])}: shutting the cluster down[/red]"
            )
            return 1
        reason = escape(why[-1]) if why else "/health 503"
        console.print(
            f"[red]the cluster is down and cannot re-form ({reason}): shutting it down[/red]",
            highlight=False,
        )
        return 1
    except KeyboardInterrupt:
        console.print("stopping every rank")
        return 0
    finally:
        # An impatient second Ctrl-C (or a supervisor signalling the whole process group) must not
        # cut the bounded shutdown short and leave ranks behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        group.shutdown()


def _down_for_good(base: str, why: list[str]) -> bool:
    """/health is 503 for a reason other than a re-form under way (its detail added to `why`)."""
    code, body = _get(f"{base}/health")
    detail = str(body.get("detail", ""))
    if code == 503 and not detail.startswith(REFORMING):
        why.append(detail)
        return True
    return False


def _wait_whole(console: Console, group: ProcessGroup, base: str, n: int, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    with console.status(f"loading weights and joining {n} rank(s)..."):
        while time.monotonic() < deadline:
            gone = group.poll()
            if gone is not None:
                return gone
            code, body = _get(f"{base}/health")
            # the real app answers only once the group was whole: a 503 from it (not the forming
            # app's) means a rank was lost since, which the serving loop then reports
            if code == 200 or (code == 503 and body and body.get("state") != "forming"):
                return None
            time.sleep(0.3)
    raise LaunchError(f"the cluster was not up within {timeout_s:.0f} s")


def _demo(console: Console, base: str, model: str, prompt: str, api_key: str | None) -> None:
    """Streams one greedy completion of `prompt` through the server, as a client would."""
    body = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), headers)
    console.print("[bold]demo[/bold] (POST /v1/completions, streamed):")
    out = Console()
    out.print(prompt, end="", style="bold", markup=False, highlight=False)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    out.print(choice.get("text", ""), end="", markup=False, highlight=False)
        out.print()
    except (urllib.error.URLError, OSError, ValueError) as e:
        console.print(f"[yellow]demo request failed: {e}[/yellow]")
