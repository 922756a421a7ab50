"""What the HTTP API gives away and lets strangers grow: request bodies are capped (413), made-up
paths share one /metrics label, /health's full detail (worker log tails) goes only to a caller
with the API key, and the key can come from a file or the environment instead of argv."""

from __future__ import annotations

import socket

import httpx
import psutil
import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from fastapi.testclient import TestClient
from http_server_support import running_server

from tandem.cli.main import build_parser
from tandem.cli.serve import ServeError, resolve_api_key
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app
from tandem.server.http_limits import MAX_BODY_BYTES

MODEL = "tiny-test"
LOG_TAIL = "Traceback ... /home/alice/models/secret-project ... peer 10.0.0.7"


def _engine(health=None) -> ServingEngine:
    sched = Scheduler(HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=64))
    sched.start()
    return ServingEngine(sched, CharTokenizer(), MODEL, health=health)


def _post_raw(port: int, head: bytes, pieces) -> bytes:
    """Sends a request head, then body pieces until the server answers or hangs up; the reply.
    (A raw socket, so the client holds no copy of the body: RSS then measures the server.)"""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(10)
    try:
        s.sendall(head)
        for piece in pieces:
            s.sendall(piece)
    except OSError:  # the server answered and closed while we were still sending
        pass
    try:
        return s.recv(65536)
    except OSError:
        return b""
    finally:
        s.close()


def test_a_16_mb_prompt_is_a_413_before_it_is_read_and_the_head_does_not_grow() -> None:
    engine = _engine()
    me = psutil.Process()
    mb = b"a" * (1 << 20)
    try:
        with running_server(create_app(engine)) as port:
            rss0 = me.memory_info().rss
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            opening = b'{"model": "tiny-test", "prompt": "'
            sized = head + b"Content-Length: %d\r\n\r\n" % (len(opening) + (16 << 20) + 2)
            reply = _post_raw(port, sized, [opening] + [mb] * 16 + [b'"}'])
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            assert b"request_too_large" in reply and str(MAX_BODY_BYTES).encode() in reply
            # no Content-Length: refused once the streamed body passes the limit
            chunked = head + b"Transfer-Encoding: chunked\r\n\r\n"
            reply = _post_raw(port, chunked, [b"100000\r\n" + mb + b"\r\n"] * 16)
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            assert me.memory_info().rss - rss0 < 20 << 20
            ok = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": MODEL, "prompt": "abc", "max_tokens": 2},
            )
            assert ok.status_code == 200
    finally:
        engine.scheduler.stop()


def test_unauthenticated_made_up_paths_share_one_metrics_label() -> None:
    engine = _engine()
    try:
        with TestClient(create_app(engine, api_key="k")) as c:
            for i in range(300):
                assert c.get(f"/v1/made-up-{i}").status_code == 401
            c.get("/v1/models/anything", headers={"Authorization": "Bearer k"})
            text = c.get("/metrics").text
    finally:
        engine.scheduler.stop()
    lines = [x for x in text.splitlines() if x.startswith("tandem_http_requests_total{")]
    assert 'tandem_http_requests_total{path="other",status="401"} 300' in lines
    assert any('path="/v1/models/{model_id}"' in x for x in lines)
    assert len(lines) <= 4, lines
    assert "made-up" not in text


def test_health_shows_worker_log_tails_only_to_a_caller_with_the_api_key() -> None:
    why = f"worker rank1 exited with code 1; its log ends:\n{LOG_TAIL}"
    engine = _engine(health=lambda: (False, why))
    try:
        with TestClient(create_app(engine, api_key="k")) as c:
            public = c.get("/health")
            wrong = c.get("/health", headers={"Authorization": "Bearer nope"})
            keyed = c.get("/health", headers={"Authorization": "Bearer k"})
        with TestClient(create_app(engine)) as c:  # no key configured: no one is authenticated
            open_ = c.get("/health")
    finally:
        engine.scheduler.stop()
    for r in (public, wrong, open_):
        assert r.status_code == 503
        assert r.json()["detail"] == "worker rank1 exited with code 1; its log ends:"
        assert "secret-project" not in r.text
    assert keyed.status_code == 503 and LOG_TAIL in keyed.json()["detail"]


def test_the_api_key_comes_from_a_file_or_the_environment_off_the_command_line(
    tmp_path, monkeypatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-from-file\n")
    parse = build_parser().parse_args
    monkeypatch.setenv("TANDEM_API_KEY", "s3cret-from-env")
    assert resolve_api_key(parse(["serve", "--api-key-file", str(key_file)])) == "s3cret-from-file"
    assert resolve_api_key(parse(["serve"])) == "s3cret-from-env"
    assert resolve_api_key(parse(["launch", "--api-key", "on-argv"])) == "on-argv"
    monkeypatch.delenv("TANDEM_API_KEY")
    assert resolve_api_key(parse(["serve"])) is None
    with pytest.raises(ServeError, match="not both"):
        resolve_api_key(parse(["serve", "--api-key-file", str(key_file), "--api-key", "x"]))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ServeError, match="first line is empty"):
        resolve_api_key(parse(["serve", "--api-key-file", str(tmp_path / "empty")]))
    with pytest.raises(ServeError, match="cannot read"):
        resolve_api_key(parse(["serve", "--api-key-file", str(tmp_path / "missing")]))
    helptext = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--api-key-file" in helptext and "TANDEM_API_KEY" in helptext and "ps" in helptext


def test_a_body_limit_refusal_leaves_the_connection_usable_for_other_clients() -> None:
    engine = _engine()
    try:
        with running_server(create_app(engine, max_body_bytes=1024)) as port:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4096\r\n\r\n"
            )
            s.settimeout(5)
            assert s.recv(4096).startswith(b"HTTP/1.1 413")
            s.close()
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": MODEL, "prompt": "abc", "max_tokens": 2},
            )
            assert r.status_code == 200
    finally:
        engine.scheduler.stop()
