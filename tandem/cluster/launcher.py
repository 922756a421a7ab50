"""A supervised group of local processes: all up together, all down together.

Each rank runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which then
shuts the ranks down in order), and with a parent-death signal (so even a SIGKILLed launcher leaves
no orphan on Linux). When any rank exits, or on Ctrl-C / SIGTERM, every rank's whole process tree
gets SIGINT, then SIGTERM after `grace_s`, then SIGKILL: nothing outlives the group, and the ports
the ranks held are released with them.

The one supervisor of the project: `tandem launch` and `cluster join` run their ranks in it, the
local TP group its workers (`engine.tp.local`), the local pipeline its stage processes
(`engine.pp.launch`, whose ranks talk to the launcher on stdin/stdout: `RankProcess.pipes`), and
`tandem bench` every process it starts on an emulated host (`bench.hosts`). Each rank's output
goes to `log_dir/NAME.log` when a `log_dir` is given; `diagnose` quotes the tail of the log of
every rank that has exited.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tandem.cluster.exits import MAPPED_FILE_EXIT, exit_cause  # noqa: F401 (re-exported)

PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A rank could not start, or exited and took the group down."""


class PortInUseError(LaunchError):
    """A port the cluster needs is already bound by another program."""


@dataclass(frozen=True)
class RankProcess:
    """How to start one rank: argv and extra environment. With `pipes`, the rank's stdin and
    stdout are pipes to the launcher (it reports on stdout, takes instructions on stdin) and only
    its stderr goes to the log."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    pipes: bool = False


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


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port with `n` consecutive ports after it that were free a moment ago (all bound
    together, then released): for a join token, whose ranks' ports follow its base port."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((host, p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise LaunchError(f"no block of {n} consecutive free ports on {host}")


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


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


class ProcessGroup:
    """Starts every rank, watches them, and tears the whole group down when one goes."""

    def __init__(
        self,
        ranks: list[RankProcess] | None = None,
        log_dir: Path | None = None,
        grace_s: float = 5.0,
    ):
        self.ranks: list[RankProcess] = []
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self._pending = list(ranks or [])
        self._logs: list = []

    def start(self) -> None:
        """Starts every rank given at construction."""
        pending, self._pending = self._pending, []
        for r in pending:
            self.spawn(r)

    def spawn(self, rank: RankProcess, **popen_kw: Any) -> subprocess.Popen:
        """Starts one more rank now; `popen_kw` (stdout=, text=, ...) overrides where its output
        goes. A rank that cannot start shuts the whole group down (LaunchError)."""
        out: Any = None
        err: Any = None
        log = self.log_path(rank.name)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            f = open(log, "wb")  # noqa: SIM115 - closed by shutdown
            self._logs.append(f)
            out, err = (subprocess.PIPE, f) if rank.pipes else (f, subprocess.STDOUT)
        elif rank.pipes:
            out = subprocess.PIPE
        kw: dict[str, Any] = {"stdout": out, "stderr": err}
        if rank.pipes:
            kw["stdin"] = subprocess.PIPE
        kw.update(popen_kw)
        try:
            p = subprocess.Popen(
                rank.argv, env={**os.environ, **rank.env}, preexec_fn=_die_with_parent, **kw
            )
        except OSError as e:
            self.shutdown()
            raise LaunchError(f"could not start {rank.name}: {e}") from e
        self.ranks.append(rank)
        self.procs.append(p)
        return p

    def log_path(self, name: str) -> Path | None:
        """Where rank `name`'s output goes (None without a `log_dir`)."""
        if self.log_dir is None:
            return None
        return self.log_dir / f"{name.replace(' ', '_')}.log"

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

    def diagnose(self, wait_s: float = 0.0, lines: int = 5) -> str | None:
        """Which ranks have exited, with what code, and the last `lines` lines of each one's log;
        None while all run. Waits up to `wait_s` for a dying rank to be reaped."""
        deadline = time.monotonic() + wait_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = []
        for r, p in zip(self.ranks, self.procs):
            code = p.poll()
            if code is not None:
                tail = self._log_tail(r.name, lines)
                gone.append(
                    f"{r.name} exited with {exit_cause(code)}" + (f": {tail}" if tail else "")
                )
        return "; ".join(gone) or None

    def _log_tail(self, name: str, lines: int) -> str:
        path = self.log_path(name)
        try:
            text = path.read_text(errors="replace") if path is not None else ""
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def rank_pids(self) -> dict[str, int]:
        """Each rank's own process id, by name."""
        return {r.name: p.pid for r, p in zip(self.ranks, self.procs)}

    def pids(self) -> list[int]:
        """Every live process of the group, ranks and their descendants."""
        return _tree_pids(self.procs)

    def end(self, proc: subprocess.Popen) -> None:
        """Brings one rank's process tree down (SIGINT, SIGTERM, SIGKILL) and reaps it."""
        _bring_down([proc], self.grace_s)

    def shutdown(self, wait_s: float = 0.0) -> None:
        """Gives ranks already told to stop `wait_s` to exit on their own (a stopped one, as a
        hung rank SIGSTOPped, never will: it is not waited for), then SIGINT every tree (and
        SIGCONT, so a stopped process takes it), then SIGTERM, then SIGKILL; returns when no
        process is left."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(
            p.poll() is None and not _stopped(p.pid) for p in self.procs
        ):
            time.sleep(0.05)
        _bring_down(self.procs, self.grace_s)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> ProcessGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _tree_pids(procs: list[subprocess.Popen]) -> list[int]:
    out = []
    for p in procs:
        if p.poll() is not None:  # reaped: its pid may already be another program's
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(p.pid)
            out.append(proc.pid)
            out.extend(c.pid for c in proc.children(recursive=True))
    return out


def _bring_down(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGINT the trees of `procs`, then SIGTERM, then SIGKILL; reap them and close their pipes."""
    tree: list[psutil.Process] = []
    for pid in _tree_pids(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            tree.append(psutil.Process(pid))
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in tree if _alive(p)]
        if not alive:
            break
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
                if sig == signal.SIGINT:  # a stopped process holds its signals until continued
                    p.send_signal(signal.SIGCONT)
        _, tree = psutil.wait_procs(alive, timeout=wait_s)
    for p in procs:  # reap the direct children so no zombie is left either
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=1.0)
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


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
