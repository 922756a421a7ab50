"""A real `tandem serve`: a DNS-rebinding `Host` is a 421 while its own names and
`--allowed-hosts` are served; a request head of 1,000 fields or 64 KB is refused as the README
says (16 KB, 100 fields)."""

import http.client
import json

import pytest
from raw_http import status_line
from serve_support import running

from tandem.loaders.gguf.writer import write_preset_gguf


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _, (f,) = write_preset_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", "tiny-qwen3", "Q8_0")
    with running(["serve", "--model", str(f), "--allowed-hosts", "proxy.example"]) as (_, base):
        yield int(base.rsplit(":", 1)[1])


def _get(port: int, host: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", "/v1/models", skip_host=True)
    conn.putheader("Host", host)
    conn.endheaders()
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    return r.status, body


def test_a_rebinding_host_is_421_and_the_servers_own_names_are_served(server):
    port = server
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"proxy.example:{port}"):
        assert _get(port, host)[0] == 200, host
    status, body = _get(port, f"rebind.example:{port}")
    assert status == 421 and body["error"]["code"] == "host_not_allowed"


def test_heads_over_the_documented_limits_are_refused(server):
    port = server
    get = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    many = get + b"".join(b"X-H%d: a\r\n" % i for i in range(1000)) + b"\r\n"
    assert status_line(port, many, 10).startswith(b"HTTP/1.1 431")
    big = get + b"X-Big: " + b"a" * (64 * 1024) + b"\r\n\r\n"
    line = status_line(port, big, 10)
    assert line == b"" or line.startswith(b"HTTP/1.1 4"), line
    assert status_line(port, get + b"\r\n", 10) == b"HTTP/1.1 200 OK"
