"""A supervised group of local processes: all up together, all down together.

Each rank runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which then
shuts the ranks down in order), and with a parent-death signal (so even a SIGKILLed launcher leaves
no orphan on Linux). When any rank exits, or on Ctrl-C / SIGTERM, every rank's whole process tree
gets SIGINT, then SIGTERM after `grace_s`, then SIGKILL: nothing outlives the group, and the ports
the ranks held are released with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A rank could not start, or exited and took the group down."""


class PortInUseError(LaunchError):
    """A port the cluster needs is already bound by another program."""


@dataclass(frozen=True)
class RankProcess:
    """How to start one rank: argv and extra environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that were free a moment ago (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_port_free(host: str, port: int) -> None:
    """Raises PortInUseError (one line, naming host:port) if `port` cannot be bound on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(
                f"port {port} on {host} is in use (by another tandem or another program): "
                "stop it or pass a different --port"
            ) from e


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ProcessGroup:
    """Starts every rank, watches them, and tears the whole group down when one goes."""

    def __init__(self, ranks: list[RankProcess], log_dir: Path | None = None, grace_s: float = 5.0):
        self.ranks = ranks
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []

    def start(self) -> None:
        for r in self.ranks:
            env = {**os.environ, **r.env}
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = open(self.log_dir / f"{r.name}.log", "wb")  # noqa: SIM115
                self._logs.append(log)
                out, err = log, subprocess.STDOUT
            else:
                out = err = None
            try:
                p = subprocess.Popen(
                    r.argv, env=env, stdout=out, stderr=err, preexec_fn=_die_with_parent
                )
            except OSError as e:
                self.shutdown()
                raise LaunchError(f"could not start {r.name}: {e}") from e
            self.procs.append(p)

    def poll(self) -> tuple[str, int] | None:
        """(name, exit code) of the first rank that has exited, or None while all run."""
        for r, p in zip(self.ranks, self.procs):
            code = p.poll()
            if code is not None:
                return r.name, code
        return None

    def wait(
        self, until: Callable[[], bool] | None = None, interval_s: float = 0.2
    ) -> tuple[str, int] | None:
        """Blocks until a rank exits (returned) or `until()` turns true (None)."""
        while True:
            gone = self.poll()
            if gone is not None:
                return gone
            if until is not None and until():
                return None
            time.sleep(interval_s)

    def pids(self) -> list[int]:
        """Every live process of the group, ranks and their descendants."""
        out = []
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(p.pid)
                out.append(proc.pid)
                out.extend(c.pid for c in proc.children(recursive=True))
        return out

    def shutdown(self) -> None:
        """SIGINT every tree, then SIGTERM, then SIGKILL; returns when no process is left."""
        tree: list[psutil.Process] = []
        for pid in self.pids():
            with contextlib.suppress(psutil.NoSuchProcess):
                tree.append(psutil.Process(pid))
        for sig, wait_s in (
            (signal.SIGINT, self.grace_s),
            (signal.SIGTERM, 2.0),
            (signal.SIGKILL, 5.0),
        ):
            alive = [p for p in tree if _alive(p)]
            if not alive:
                break
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(sig)
            _, tree = psutil.wait_procs(alive, timeout=wait_s)
        for p in self.procs:  # reap the direct children so no zombie is left either
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1.0)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> ProcessGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt():
    """So `kill <launcher>` shuts the group down through the same path as Ctrl-C."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
