"""Emulated hosts on one machine: network namespaces on a bridge, each port rate-limited with tbf.

Topology for `n_hosts` hosts (names carry a per-run prefix, so runs never collide):

    {prefix}-h0 (10.77.S.1, dev {prefix}h0) ─veth─ {prefix}p0 ┐
    {prefix}-h1 (10.77.S.2, dev {prefix}h1) ─veth─ {prefix}p1 ├─ bridge br0 in {prefix}-hub
    ...                                                        ┘

Each host's veth end is shaped on egress (its upload) and the hub end on egress (its download), so
every host has a full-duplex `rate` port on an emulated switch, like a 2.5 GbE NIC. `netem` is not
available on these machines, so no delay is added: the emulated latency is the veth's own (tens of
microseconds), close to a direct cable's. Only addresses inside these namespaces are ever used.

The command lists are built by pure methods (unit-tested); `EmulatedNetwork.up()` runs them and
tears everything down by name on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

NAME_PREFIX = "tdb"  # every namespace and interface this module creates starts with this
_MAX_IFNAME = 15  # Linux IFNAMSIZ - 1


class NetnsUnavailable(RuntimeError):
    """Link emulation cannot run here (not root, or `ip`/`tc` missing, or namespaces refused)."""


class NetnsCommandFailed(RuntimeError):
    """A set-up command failed; everything created so far has been torn down."""


@dataclass(frozen=True)
class Shaping:
    """A token-bucket rate limit (`tc qdisc ... tbf`) applied to each egress of every port.

    `burst_bytes` must cover one GSO segment (64 KiB) or tbf drops it; `queue_ms` bounds the queue.
    """

    rate_mbit: int = 2500
    burst_bytes: int = 256 * 1024
    queue_ms: int = 50

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0 or self.burst_bytes < 65536 or self.queue_ms <= 0:
            raise ValueError(f"invalid shaping {self}: rate > 0, burst >= 64 KiB, queue > 0 ms")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8


@dataclass(frozen=True)
class EmulatedNetwork:
    """`n_hosts` namespaces on one bridge; `shaping=None` leaves the ports unshaped."""

    n_hosts: int
    shaping: Shaping | None = Shaping()
    tag: str = ""  # a few hex chars unique to this run; `new()` picks one
    subnet: int = 0  # the third octet: 10.77.<subnet>.0/24

    def __post_init__(self) -> None:
        if not 1 <= self.n_hosts <= 250:
            raise ValueError(f"n_hosts must be in 1..250, got {self.n_hosts}")
        if not 0 <= self.subnet <= 255:
            raise ValueError(f"subnet must be an octet, got {self.subnet}")
        if not self.tag.isalnum() or len(self.prefix) + 4 > _MAX_IFNAME:
            raise ValueError(f"tag must be a short alphanumeric string, got {self.tag!r}")

    @classmethod
    def new(cls, n_hosts: int, shaping: Shaping | None = Shaping()) -> EmulatedNetwork:
        return cls(n_hosts=n_hosts, shaping=shaping, tag=secrets.token_hex(3))

    @property
    def prefix(self) -> str:
        return f"{NAME_PREFIX}{self.tag}"

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, host: int) -> str:
        self._check_host(host)
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        """The host's IPv4 address (exists only inside this run's namespaces)."""
        self._check_host(host)
        return f"10.77.{self.subnet}.{host + 1}"

    def host_dev(self, host: int) -> str:
        return f"{self.prefix}h{host}"

    def hub_dev(self, host: int) -> str:
        return f"{self.prefix}p{host}"

    def namespaces(self) -> list[str]:
        return [self.hub] + [self.namespace(h) for h in range(self.n_hosts)]

    def setup_commands(self) -> list[list[str]]:
        """The `ip`/`tc` commands that build the topology, in order."""
        cmds: list[list[str]] = [["ip", "netns", "add", ns] for ns in self.namespaces()]
        cmds += [
            ["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", self.hub, "link", "set", "br0", "up"],
        ]
        for h in range(self.n_hosts):
            ns, dev, port = self.namespace(h), self.host_dev(h), self.hub_dev(h)
            cmds += [
                ["ip", "link", "add", dev, "type", "veth", "peer", "name", port],
                ["ip", "link", "set", dev, "netns", ns],
                ["ip", "link", "set", port, "netns", self.hub],
                ["ip", "-n", self.hub, "link", "set", port, "master", "br0"],
                ["ip", "-n", self.hub, "link", "set", port, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", dev],
                ["ip", "-n", ns, "link", "set", dev, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
            if self.shaping is not None:
                cmds.append(self._tbf(ns, dev))
                cmds.append(self._tbf(self.hub, port))
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Deletes by name: a namespace takes its veth ends with it; stray root-side ends too."""
        cmds = [["ip", "netns", "del", ns] for ns in self.namespaces()]
        for h in range(self.n_hosts):
            cmds.append(["ip", "link", "del", self.host_dev(h)])
        return cmds

    def exec_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def counters_argv(self, host: int, dev: str | None = None) -> list[str]:
        """Reads the host's interface statistics as JSON (`ip -s -j link show`)."""
        dev = dev or self.host_dev(host)
        return ["ip", "-n", self.namespace(host), "-s", "-j", "link", "show", dev]

    def _tbf(self, ns: str, dev: str) -> list[str]:
        s = self.shaping
        assert s is not None
        return [
            "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{s.rate_mbit}mbit", "burst", str(s.burst_bytes), "latency", f"{s.queue_ms}ms",
        ]  # fmt: skip

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.n_hosts:
            raise ValueError(f"host {host} out of range 0..{self.n_hosts - 1}")

    # ---- effects -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def up(self) -> Iterator[EmulatedNetwork]:
        """Builds the network, yields it, and always tears it down (also on SIGTERM)."""
        check_available()
        previous = signal.getsignal(signal.SIGTERM)

        def _on_term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        in_main = _in_main_thread()
        if in_main:
            signal.signal(signal.SIGTERM, _on_term)
        try:
            for cmd in self.setup_commands():
                _run(cmd)
            yield self
        finally:
            self.teardown()
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    def teardown(self) -> None:
        for cmd in self.teardown_commands():
            subprocess.run(cmd, capture_output=True, timeout=30)

    def tx_rx_bytes(self, host: int, dev: str | None = None) -> tuple[int, int]:
        """Bytes sent and received on the host's port (or `dev`) so far, headers included."""
        out = subprocess.run(
            self.counters_argv(host, dev), capture_output=True, text=True, timeout=10, check=True
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def check_available() -> None:
    """Raises `NetnsUnavailable` with what to do, unless root with `ip` and `tc` on PATH."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "link emulation needs root (network namespaces, veth, tc); run as root or skip it"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(
            f"link emulation needs {' and '.join(missing)} on PATH: install iproute2 "
            "(Debian: apt-get install iproute2)"
        )


def stale_namespaces() -> list[str]:
    """Namespaces left by an earlier run of this module that was killed with SIGKILL."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NAME_PREFIX) and ("-h" in n or n.endswith("-hub"))]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetnsCommandFailed(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
