"""A model's chat template rendered in its own bounded process (`template_sandbox.py`).

`TemplateRenderer.render` sends the messages to the sandbox process and waits at most the time
bound plus a grace second; a process that has not answered by then (stuck in a C call) is
killed. Every limit it runs into is a `TemplateLimitError` naming the limit, and the next render
starts a fresh process. The process is started once per template and reused; renders are
serialized (a template renders in milliseconds). Without jinja2 in this process: the head
imports it nowhere."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.loaders.errors import ChatTemplateError, ChatTemplateRefused, TemplateLimitError

SANDBOX = Path(__file__).with_name("template_sandbox.py")
GRACE_S = 1.0  # past the time bound, the parent stops waiting and kills the process
START_S = 10.0  # the interpreter and jinja2's import, on a loaded machine


@dataclass(frozen=True)
class TemplateLimits:
    """The bounds of one render: wall seconds, characters of the rendered prompt, and the
    sandbox process's address space (Linux; elsewhere the time bound stays)."""

    seconds: float = 5.0
    output_chars: int = 8 << 20
    memory_bytes: int = 512 << 20

    def describe(self, limit: str) -> str:
        if limit == "time":
            return f"time limit ({self.seconds:g} s)"
        if limit == "output":
            return f"output limit ({self.output_chars} characters)"
        return f"memory limit ({self.memory_bytes >> 20} MiB)"


class TemplateRenderer:
    """Renders one template (`tokens`: bos_token, eos_token, ... as the template sees them);
    `origin` names where it came from in every error."""

    def __init__(
        self,
        template: str,
        tokens: dict[str, str],
        origin: str,
        limits: TemplateLimits | None = None,
    ) -> None:
        self.template, self.tokens, self.origin = template, dict(tokens), origin
        self.limits = limits or TemplateLimits()
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None
        self._broken: ChatTemplateError | None = None  # a template that does not compile

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]
    ) -> str:
        request = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "extra": extra,
        }
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._ensure_started()
            return self._answer(self._exchange(request))["text"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", str(SANDBOX)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self._finalizer = weakref.finalize(self, _end, self._proc)
        setup = {
            "template": self.template,
            "tokens": self.tokens,
            "seconds": self.limits.seconds,
            "output_chars": self.limits.output_chars,
            "memory_bytes": self.limits.memory_bytes,
        }
        try:
            self._answer(self._exchange(setup, extra_s=START_S))
        except TemplateLimitError:
            raise
        except ChatTemplateError as e:
            self._stop()
            self._broken = e
            raise

    def _exchange(self, message: dict[str, Any], extra_s: float = 0.0) -> dict[str, Any]:
        """Sends `message`, reads the one-line answer within the time bound + grace (+
        `extra_s`); a process that does not answer in time is killed (a "time" answer)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(message, ensure_ascii=False).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died()
        deadline = time.monotonic() + self.limits.seconds + GRACE_S + extra_s
        buf = bytearray()
        most = 8 * self.limits.output_chars + (1 << 20)  # escaped text + JSON
        fd = proc.stdout.fileno()
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                proc.kill()  # stuck in a C call the sandbox's timer cannot interrupt
                self._stop()
                return {"error": "limit", "limit": "time"}
            chunk = os.read(fd, 1 << 20)
            if not chunk or len(buf) + len(chunk) > most:
                return self._died()
            buf += chunk
        try:
            answer = json.loads(buf)
        except ValueError:
            return self._died()
        return answer if isinstance(answer, dict) else self._died()

    def _died(self) -> dict[str, Any]:
        """The process ended (or spoke nonsense) without an answer: SIGXCPU is its CPU cap, a
        SIGKILL most likely the kernel's answer to its memory."""
        proc = self._proc
        self._stop()
        code = proc.returncode if proc is not None else None
        if code == -signal.SIGXCPU:
            return {"error": "limit", "limit": "time"}
        if code == -signal.SIGKILL:
            return {"error": "limit", "limit": "memory"}
        return {"error": "template", "message": f"the template's process ended (exit {code})"}

    def _answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        kind = answer.get("error")
        if kind is None:
            return answer
        if kind == "limit":
            self._stop()  # a fresh process for the next render
            limit = str(answer.get("limit"))
            raise TemplateLimitError(
                f"{self.origin}: the chat template went past its {self.limits.describe(limit)} "
                "rendering these messages",
                limit,
            )
        message = str(answer.get("message", ""))
        if kind == "refused":
            raise ChatTemplateRefused(f"chat template refused the messages: {message}")
        raise ChatTemplateError(f"{self.origin}: chat template failed: {message}")

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # ends the process once; detached from then on
            self._finalizer = None
        self._proc = None


def _end(proc: subprocess.Popen) -> None:
    """Ends the sandbox process: its stdin closed (it exits at once when idle), then killed."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(0.5)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    with contextlib.suppress(OSError):
        if proc.stdout is not None:
            proc.stdout.close()
