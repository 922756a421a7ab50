"""The web page's server side in-process: the page and its files under a strict CSP, the API key on
every route the page uses, `/v1/cluster` rates from counter differences, and the same figures in
`/metrics`. (The page itself runs in a real browser in tests/e2e/test_web_page.py.)"""

import re
import time
from importlib import resources

import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from fastapi.testclient import TestClient

from tandem.engine import cluster_info as ci
from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server import cluster_view
from tandem.server.app import create_app
from tandem.server.cluster_view import ClusterMonitor, render_cluster_metrics
from tandem.server.page import STATIC_FILES

MODEL = "tiny-test"
KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# every API call the page's scripts make (static/app.js, chat.js, cluster.js)
PAGE_CALLS = [("GET", "/v1/models", None), ("GET", "/v1/cluster", None)]
PAGE_CALLS += [("POST", "/v1/chat/completions", CHAT)]


@pytest.fixture
def engine():
    ex = HistoryExecutor(vocab=128, span=26, offset=97)
    sched = Scheduler(ex)
    sched.start()
    yield ServingEngine(sched, CharTokenizer(), MODEL)
    sched.stop()


def _static(name):
    return resources.files("tandem.server").joinpath("static", name).read_text()


def test_page_and_every_static_file_carry_a_strict_content_security_policy(engine):
    with TestClient(create_app(engine)) as c:
        for path in ["/", *(f"/static/{n}" for n in STATIC_FILES)]:
            r = c.get(path)
            assert r.status_code == 200, path
            csp = r.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp
            assert "unsafe" not in csp and r.headers["x-content-type-options"] == "nosniff"
        assert c.get("/static/app.js").headers["content-type"].startswith("text/javascript")


def test_static_route_serves_only_the_shipped_files(engine):
    with TestClient(create_app(engine)) as c:
        for name in ("index.html", "page.py", "..%2Fpage.py", "%2e%2e%2fapp.py", "x.js"):
            assert c.get(f"/static/{name}").status_code == 404, name


def test_page_scripts_insert_text_only_never_html():
    """Model and user text reaches the DOM through textContent; nothing parses strings as HTML or
    code, and the HTML has no inline script or style for the CSP to have to allow."""
    forbidden = re.compile(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|setAttribute\(\s*['\"]on"
    )
    for name in STATIC_FILES:
        if name.endswith(".js"):
            assert not forbidden.search(_static(name)), name
    html = _static("index.html")
    assert "<script>" not in html and "style=" not in html
    assert not re.search(r"\son[a-z]+\s*=", html)  # no inline event handlers
    assert re.findall(r"<script[^>]*>", html) == ['<script type="module" src="/static/app.js">']


def test_with_a_key_every_route_the_page_uses_refuses_a_missing_or_wrong_key(engine):
    with TestClient(create_app(engine, api_key=KEY)) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            for method, path, body in PAGE_CALLS:
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        for method, path, body in PAGE_CALLS:
            assert c.request(method, path, json=body, headers=AUTH).status_code == 200, path
        page = c.get("/")  # the page loads without a key and holds no data
        assert page.status_code == 200 and MODEL not in page.text


def test_cluster_view_rates_are_counter_differences_between_samples(engine, monkeypatch):
    monkeypatch.setattr(cluster_view, "MIN_INTERVAL_S", 0.0)
    monitor = ClusterMonitor(engine)
    first = monitor.view()
    assert first.history == [] and first.tokens_per_s is None  # one sample: no rate yet
    with TestClient(create_app(engine)) as c:
        assert c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 9}).status_code == 200
    time.sleep(0.05)
    second = monitor.view()
    made = second.generated_tokens - first.generated_tokens
    assert made == 9
    (s,) = second.history
    assert s.tokens_per_s == pytest.approx(made / (s.t - first.time), rel=1e-6)
    assert second.tokens_per_s == s.tokens_per_s
    assert second.decode_ms_per_step is not None and second.decode_ms_per_step > 0
    (r,) = second.ranks
    assert r.wait_fraction is None  # one device: no peers to wait for
    assert second.state == "whole" and second.links == []


def test_a_failed_engine_reports_failed_whatever_the_executor_says():
    ex = HistoryExecutor(vocab=128, span=26, offset=97, fail_after=0)
    sched = Scheduler(ex)
    sched.start()
    engine = ServingEngine(sched, CharTokenizer(), MODEL)
    try:
        with TestClient(create_app(engine)) as c:
            c.post("/v1/chat/completions", json=CHAT)
            doc = c.get("/v1/cluster").json()
        assert doc["state"] == "failed" and "rank 1 closed the connection" in doc["detail"]
    finally:
        sched.stop()


def _view(host="h", rtt=None):
    facts = ci.RankFacts(0, "head", host, "cpu", "float32", None, ci.layer_shard((0, 2)))
    desc = ci.Description(
        "tp", 2, 1, [facts, ci.RankFacts(1, "worker", "w", "cpu", "f", None, {"layers": [0, 2]})]
    )
    desc.links = [ci.link(0, 1, "ring", rtt)]

    class _Engine:
        model_name = MODEL

        def cluster(self):
            d = desc.as_dict()
            d["scheduler"] = dict.fromkeys(
                ("steps", "step_seconds", "decode_steps", "decode_seconds", "prompt_tokens"), 0
            )
            d["scheduler"] |= {"generated_tokens": 0, "running": 0, "waiting": 0}
            return d

    return ClusterMonitor(_Engine()).view()


def test_cluster_metrics_escape_labels_and_leave_unmeasured_figures_out():
    text = render_cluster_metrics(_view(host='evil"}\nx 1 \\'))
    assert 'host="evil\\"}\\nx 1 \\\\"' in text
    assert 'tandem_cluster_state{state="whole"} 1' in text
    assert 'tandem_cluster_state{state="failed"} 0' in text
    assert "tandem_link_rtt_seconds" not in text and "goodput" not in text
    assert "tandem_rank_resident_memory_bytes" not in text  # no rank here is a local process
    assert 'tandem_link_rtt_seconds{a="0",b="1"} 0.0025' in render_cluster_metrics(_view(rtt=2.5))
    for line in text.splitlines():  # every sample line is `name{labels} value` on one line
        assert line.startswith("#") or re.fullmatch(r"tandem_\w+(\{.*\})? \S+", line), line


def test_metrics_carry_the_per_rank_series(engine):
    with TestClient(create_app(engine)) as c:
        text = c.get("/metrics").text
    assert 'tandem_rank_info{rank="0",role="head",host="test-host"' in text
    assert 'tandem_rank_work_share{rank="0"} 1.0' in text
    assert re.search(r'tandem_rank_resident_memory_bytes\{rank="0"\} \d+', text)


def test_while_forming_the_page_loads_and_the_api_says_forming_behind_the_key():
    from tandem.server.forming import create_forming_app

    with TestClient(create_forming_app(MODEL, tp=2, pp=1, api_key=KEY)) as c:
        assert c.get("/").status_code == 200 and c.get("/static/app.js").status_code == 200
        for method, path, body in PAGE_CALLS:
            assert c.request(method, path, json=body).status_code == 401, path
        doc = c.get("/v1/cluster", headers=AUTH).json()
        assert doc["state"] == "forming" and doc["ranks"] == [] and doc["model"] == MODEL
        assert doc["layout"] == {"kind": "tp", "tp": 2, "pp": 1, "world_size": 2}
        for method, path, body in PAGE_CALLS[:1] + PAGE_CALLS[2:]:
            r = c.request(method, path, json=body, headers=AUTH)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert c.get("/health").status_code == 503
        assert 'tandem_cluster_state{state="forming"} 1' in c.get("/metrics").text


def test_the_app_switch_hands_requests_to_the_engine_once_it_is_up(engine):
    from tandem.server.forming import AppSwitch, create_forming_app

    switch = AppSwitch(create_forming_app(MODEL, tp=1, pp=1))
    with TestClient(switch) as c:
        assert c.get("/v1/cluster").json()["state"] == "forming"
        switch.app = create_app(engine)
        assert c.get("/v1/cluster").json()["state"] == "whole"
        assert c.get("/health").status_code == 200
