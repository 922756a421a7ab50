"""The chat template's own process: a jinja2 sandbox under a time, output and memory bound.

A template is data from the model file, and jinja2's sandbox stops it from reaching Python
objects but not from looping for ever or building a string of gigabytes (three nested
`range(100000)` loops took a server from 114 MB to 4.7 GB). A thread cannot be stopped in the
middle of a C call, so the template runs here, in a process the parent can kill
(`tandem.loaders.chat_template`): its address space capped (`RLIMIT_AS`), a timer interrupting
the render at the time bound, its CPU time capped a little past it (`RLIMIT_CPU`: a C call the
timer cannot interrupt ends the process), and the rendered text counted as it streams and
refused past the output bound.

Run by path (`python -I template_sandbox.py`): it imports only the standard library and jinja2.
One JSON line in, one JSON line out. The first line sets it up: {"template", "tokens",
"seconds", "output_chars", "memory_bytes"}; the answer is {"ok": true} or an error. Each later
line is {"messages", "add_generation_prompt", "extra"}, answered {"text": ...} or an error:
{"error": "limit", "limit": "time" | "output" | "memory"}, {"error": "refused", "message"} (the
template's `raise_exception`) or {"error": "template", "message"}.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import sys
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Deadline(BaseException):
    """The time bound passed (raised by SIGALRM; a BaseException, so no template code or
    jinja2 handler catches it)."""


class _OutputBound(Exception):
    pass


class _Refused(Exception):
    pass


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise _Deadline


def _cap_cpu(seconds: float) -> None:
    """The process's CPU time capped `seconds` + 2 past what it has used (SIGXCPU ends it): the
    backstop for a C call the timer cannot interrupt, even with the parent gone. Only the soft
    limit moves, so the next render may raise it again."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(use.ru_utime + use.ru_stime + seconds) + 2
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _cap_memory(nbytes: int) -> None:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):  # macOS does not take RLIMIT_AS: the time bound stays
        pass


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders in: loop controls, `tojson`, `raise_exception`,
    `strftime_now` (Llama 3 templates)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )

    def raise_exception(message: str) -> None:
        raise _Refused(str(message))

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _render(template: jinja2.Template, tokens: dict[str, str], req: dict, cap: int) -> str:
    parts, n = [], 0
    ctx = {**req.get("extra", {}), **tokens}
    ctx["messages"] = req["messages"]
    ctx["add_generation_prompt"] = bool(req.get("add_generation_prompt", True))
    for chunk in template.generate(**ctx):
        n += len(chunk)
        if n > cap:
            raise _OutputBound
        parts.append(chunk)
    return "".join(parts)


def _bounded(work, seconds: float) -> dict[str, Any]:
    """`work()`'s answer, or the error it ran into, under the time bound."""
    try:
        try:
            _cap_cpu(seconds)
            signal.setitimer(signal.ITIMER_REAL, seconds)
            return work()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return {"error": "limit", "limit": "time"}
    except MemoryError:
        return {"error": "limit", "limit": "memory"}
    except _OutputBound:
        return {"error": "limit", "limit": "output"}
    except _Refused as e:
        return {"error": "refused", "message": str(e)}
    except RecursionError:
        return {"error": "template", "message": "recursion too deep"}
    except Exception as e:  # a template error of any kind, or a request that is not one
        return {"error": "template", "message": f"{type(e).__name__}: {e}"}


def _send(out, answer: dict[str, Any]) -> None:
    out.write(json.dumps(answer, ensure_ascii=False).encode() + b"\n")
    out.flush()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    setup = json.loads(inp.readline() or b"null")
    if not isinstance(setup, dict):
        return 2
    seconds, cap = float(setup["seconds"]), int(setup["output_chars"])
    tokens = {k: str(v) for k, v in setup["tokens"].items()}
    _cap_memory(int(setup["memory_bytes"]))
    compiled: list[jinja2.Template] = []

    def compile_template() -> dict[str, Any]:  # constant folding runs here: bounded too
        compiled.append(_environment().from_string(setup["template"]))
        return {"ok": True}

    answer = _bounded(compile_template, seconds)
    _send(out, answer)
    if not compiled:
        return 1
    for line in inp:  # until the parent closes the pipe

        def render(line: bytes = line) -> dict[str, Any]:
            return {"text": _render(compiled[0], tokens, json.loads(line), cap)}

        _send(out, _bounded(render, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
