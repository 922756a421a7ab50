"""DNS rebinding: a page on a stranger's domain re-pointed at 127.0.0.1 makes a browser send
`Host: that-domain`. The server answers only the names it was bound under (the bound address,
localhost, 127.0.0.1, [::1]; for a wildcard bind this machine's names and any IP literal) plus
`--allowed-hosts`, and a 421 to anything else before the app sees it."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
from fastapi import FastAPI

from tandem.cluster.launcher import free_ports
from tandem.server.forming import BackgroundServer
from tandem.server.hosts import AllowedHosts, host_name


@pytest.mark.parametrize(
    "header, name",
    [
        ("127.0.0.1:8000", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("example.com.:80", "example.com"),
        ("::1", "::1"),
    ],
)
def test_the_name_in_a_host_header_drops_the_port_and_the_case(header, name):
    assert host_name(header) == name


def test_a_loopback_bind_answers_its_own_names_and_addresses_and_no_other_name():
    """An IP literal is never a rebinding page's Host (its origin is the address itself)."""
    allowed = AllowedHosts.for_bind("127.0.0.1")
    for ok in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "LOCALHOST", "10.0.0.1", None):
        assert allowed.allows(ok), ok
    for bad in ("rebind.example:8000", "127.0.0.1.rebind.example", "0x7f.1", "", "[evil]"):
        assert not allowed.allows(bad), bad
    assert not allowed.allows(socket.gethostname()) or socket.gethostname() == "localhost"


def test_a_wildcard_bind_also_answers_this_machines_names_but_no_other_name():
    allowed = AllowedHosts.for_bind("0.0.0.0")
    for ok in ("192.168.77.1:8000", "[fe80::1]:8000", socket.gethostname(), "localhost"):
        assert allowed.allows(ok), ok
    assert not allowed.allows("rebind.example:8000")


def test_allowed_hosts_adds_names_and_a_star_turns_the_check_off():
    allowed = AllowedHosts.for_bind("10.0.0.5", ["proxy.lan", " "])
    assert allowed.allows("proxy.lan:443") and allowed.allows("10.0.0.5:8000")
    assert allowed.allows("localhost") and not allowed.allows("other.lan")
    assert AllowedHosts.for_bind("127.0.0.1", ["*"]).allows("anything.example")


def _get(port: int, host: str | None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.putrequest("GET", "/health", skip_host=True)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, json.loads(body)


def test_the_server_answers_a_rebinding_host_421_before_the_app_sees_it():
    app, seen = FastAPI(), []

    @app.get("/health")
    async def health():
        seen.append(1)
        return {"status": "ok"}

    (port,) = free_ports(1)
    server = BackgroundServer(app, "127.0.0.1", port, 1.0)
    server.start()
    try:
        assert _get(port, f"127.0.0.1:{port}")[0] == 200
        assert _get(port, f"localhost:{port}")[0] == 200
        status, body = _get(port, f"rebind.example:{port}")
        assert status == 421 and body["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts" in body["error"]["message"]
        assert len(seen) == 2
    finally:
        server.stop()
