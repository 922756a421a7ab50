"""Where a benchmark's processes run: all on loopback, or one emulated host each (`netns.py`).

A `Hosts` object starts a command "on host i" and tells its address; the harness does not care
which. Every process it starts runs in its `cluster.launcher.ProcessGroup` and goes down with its
whole tree when the `Hosts` closes (or with this process, by the parent-death signal). Ranks on
emulated hosts are told (TANDEM_SHM=0) not to use same-host shared memory: the namespaces share
one /dev/shm, but they stand for machines that do not.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence

from tandem.bench.goodput import LinkFigures
from tandem.bench.netns import EmulatedNetwork
from tandem.cluster.launcher import ProcessGroup, RankProcess
from tandem.transport.shm import SHM_ENV


class HostProcessFailed(RuntimeError):
    """A process started on an emulated host exited badly or said something unexpected."""


class Hosts:
    """`n` hosts: loopback (`net=None`: every host is 127.0.0.1) or the namespaces of `net`."""

    def __init__(self, n: int, net: EmulatedNetwork | None = None, loopback: bool = False) -> None:
        """`loopback=True` with a `net` puts every host on the loopback of `net`'s host 0, so its
        byte counters see only this run's traffic."""
        if net is not None and net.n_hosts < (1 if loopback else n):
            raise ValueError(f"network has {net.n_hosts} hosts, {n} needed")
        self.n = n
        self.net = net
        self.loopback = loopback or net is None
        self._group = ProcessGroup(grace_s=2.0)

    @property
    def name(self) -> str:
        if self.loopback:
            return "loopback"
        s = self.net.shaping
        return f"emulated {s.rate_mbit} Mbit/s" if s else "emulated unshaped"

    def address(self, host: int) -> str:
        if not 0 <= host < self.n:
            raise ValueError(f"host {host} out of range 0..{self.n - 1}")
        return "127.0.0.1" if self.loopback else self.net.address(host)

    def device(self, host: int) -> str:
        """The network interface host `host` talks through."""
        self.address(host)
        return "lo" if self.loopback else self.net.host_dev(host)

    def namespace(self, host: int) -> str | None:
        """The network namespace host `host` runs in (None without namespaces)."""
        self.address(host)
        if self.net is None:
            return None
        return self.net.namespace(0 if self.loopback else host)

    def argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` as it must be run to execute on `host`."""
        self.address(host)
        if self.net is None:
            return list(argv)
        return self.net.exec_argv(0 if self.loopback else host, argv)

    def wire_bytes(self) -> int | None:
        """Bytes sent so far by every host (headers included); None without namespaces."""
        if self.net is None:
            return None
        if self.loopback:
            return self.net.tx_rx_bytes(0, dev="lo")[0]
        return sum(self.net.tx_rx_bytes(h)[0] for h in range(self.n))

    def popen(
        self, host: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw
    ) -> subprocess.Popen:
        extra = dict(env or {})
        if not self.loopback:  # emulated hosts are separate machines: their ranks talk by TCP
            extra[SHM_ENV] = "0"
        name = f"host{host}-{len(self._group.procs)}"
        return self._group.spawn(RankProcess(name, self.argv(host, argv), extra), **kw)

    def run(self, host: int, argv: Sequence[str], timeout: float, env=None) -> str:
        """Runs to completion on `host`; returns stdout; raises with stderr on failure."""
        proc = self.popen(
            host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise HostProcessFailed(
                f"{argv[:4]} timed out after {timeout}s: {err[-2000:]}"
            ) from None
        if proc.returncode != 0:
            raise HostProcessFailed(f"{argv[:4]} exited {proc.returncode}: {err[-2000:]}")
        return out

    def measure_link(self, a: int, b: int, payload_bytes: int = 64 << 20) -> LinkFigures:
        """TCP round trip and goodput from host `a` to host `b`."""
        server = self.popen(
            b,
            [sys.executable, "-m", "tandem.bench.goodput", "serve", "--host", self.address(b)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = read_line(server, timeout=30.0)
            if not line.startswith("PORT "):
                raise HostProcessFailed(f"goodput server said {line!r}")
            port = line.split()[1]
            out = self.run(
                a,
                [sys.executable, "-m", "tandem.bench.goodput", "measure", "--host",
                 self.address(b), "--port", port, "--bytes", str(payload_bytes)],
                timeout=120.0,
            )  # fmt: skip
            server.wait(timeout=30)
            return LinkFigures(**json.loads(out))
        finally:
            self._group.end(server)

    def close(self) -> None:
        self._group.shutdown()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line, or `HostProcessFailed` if the process dies or stays silent too long."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                return proc.stdout.readline().strip()
            if proc.poll() is not None:
                raise HostProcessFailed(f"process exited {proc.returncode} before answering")
    raise HostProcessFailed(f"no answer within {timeout}s")
