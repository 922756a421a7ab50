"""Which `Host` a request may name. A web page on a stranger's domain whose name it re-points at
127.0.0.1 (DNS rebinding) makes the visitor's browser send it requests with `Host: that-domain`;
a server that answers them is driven by the page, without an API key when none is set. So only
the names this server was bound under are answered: the bound address, `localhost`, and any IP
literal (127.0.0.1, [::1], the address a NAT forwards to it: a rebinding page needs a name of its
own in `Host`, never an address, whose origin the browser keeps apart); for a wildcard bind
(0.0.0.0, ::) also this machine's host names. `--allowed-hosts` adds names; `*` turns the check
off. Anything else is a 421 before the app sees the request."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.server.http_limits import send_error
from tandem.server.protocol import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")


def host_name(header: str) -> str:
    """The name in a `Host` header value, port dropped, lowercased: "[::1]:8000" -> "::1"."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    name, colon, port = h.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        h = name
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowedHosts:
    """The names a `Host` header may carry (lowercase, no port); `any_ip`: any IP literal too
    (safe: module docstring); `anything`: no check."""

    names: frozenset[str]
    any_ip: bool = True
    anything: bool = False

    @classmethod
    def for_bind(cls, bind: str, extra: Iterable[str] = ()) -> AllowedHosts:
        """The defaults for a server bound to `bind`, plus `extra` (`--allowed-hosts`)."""
        extra = [host_name(e) for e in extra if e.strip()]
        if "*" in extra:
            return cls(frozenset(), anything=True)
        names = {*LOOPBACK_NAMES, *extra}
        wildcard = bind.strip() in WILDCARD_BINDS
        if wildcard:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            names.add(host_name(bind))
        return cls(frozenset(n for n in names if n))

    def allows(self, header: str | None) -> bool:
        """Whether a request with this `Host` is answered (none at all: an HTTP/1.0 client, not
        a browser)."""
        if self.anything or header is None:
            return True
        name = host_name(header)
        return name in self.names or (self.any_ip and _is_ip(name))


class HostCheck:
    """ASGI middleware: a request whose `Host` is not allowed gets a 421 in OpenAI's error shape
    and never reaches `app`."""

    def __init__(self, app, allowed: AllowedHosts) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [v for k, v in scope.get("headers") or () if k == b"host"]
        header = hosts[0].decode("latin-1") if hosts else None
        if len(hosts) < 2 and self.allowed.allows(header):
            await self.app(scope, receive, send)
            return
        err = APIError(
            421,
            f"this server does not answer to Host {(header or '')[:100]!r}; start it with "
            "--allowed-hosts NAME to allow a name",
            code="host_not_allowed",
        )
        await send_error(send, err)
