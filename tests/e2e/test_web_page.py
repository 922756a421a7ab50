"""The web page in a real headless Chromium (Debian's chromium + chromium-driver, driven by selenium)
against a live `tandem serve --tp 2` of the built-in model with an API key: real processes, real
sockets, the page's own JavaScript.

`TANDEM_SCREENSHOT=docs/web-page.png` also writes the screenshot the README shows.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_support import TANDEM, kill_tree, output, spawn, wait_healthy

from tandem.builtin import default_model_dir
from tandem.cluster.launcher import free_ports

ROOT = Path(__file__).resolve().parents[2]
KEY = "page-test-key"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
    "--disable-background-networking --disable-component-update --disable-sync "
    "--window-size=1280,800 --hide-scrollbars"
).split()
QUESTION = "How do I open a file?"
FOLLOW_UP = "And how do I read it line by line?"
MAX_TOKENS = 48
HOSTILE = '<img src=x onerror="window.__pwned = 1"><script>window.__pwned2 = 1</script>'


def _chromium_or_skip() -> None:
    """Installs chromium through scripts/browser.sh when missing; skips only when it cannot."""
    if os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK):
        return
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "browser.sh")], capture_output=True, text=True, timeout=900
    )
    if r.returncode != 0 or not os.access(CHROMEDRIVER, os.X_OK):
        pytest.skip(f"chromium cannot be installed here: {r.stderr.strip()[-400:]}")


# Before the page's own scripts: the key in sessionStorage, and every state the badge shows.
RECORD_STATES = f"""
sessionStorage.setItem("tandem.apiKey", "{KEY}");
window.__states = [];
document.addEventListener("DOMContentLoaded", () => {{
  const badge = document.getElementById("cluster-state");
  new MutationObserver(() => {{
    if (window.__states.at(-1) !== badge.textContent) window.__states.push(badge.textContent);
  }}).observe(badge, {{childList: true, characterData: true, subtree: true}});
}});
"""


# Loaded by every process of the served cluster (a `sitecustomize` on their PYTHONPATH; the
# product has no such switch): the worker waits before it joins, so the cluster stays forming
# long enough for the page to be seen forming however fast the model loads.
DELAYED_JOIN = 'import sys, time\nif sys.orig_argv[3:4] == ["worker"]:\n    time.sleep(4)\n'


@pytest.fixture(scope="module")
def starting(tmp_path_factory):
    """`tandem serve --tp 2` as soon as its port answers (the cluster still forming)."""
    site = tmp_path_factory.mktemp("delayed-join")
    (site / "sitecustomize.py").write_text(DELAYED_JOIN)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    (port,) = free_ports(1)
    argv = [*TANDEM, "serve", "--model", str(default_model_dir()), "--tp", "2"]
    argv += ["--max-batch", "4", "--port", str(port), "--reform-timeout", "0"]  # a loss ends it
    proc = spawn(argv, env={**os.environ, "TANDEM_API_KEY": KEY, "PYTHONPATH": path})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, output(proc)[-3000:]
            assert time.monotonic() < deadline, "the port never answered"
            try:
                if httpx.get(base + "/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield proc, base, _cluster(base).json()
    finally:
        kill_tree(proc)


@pytest.fixture(scope="module")
def server(starting):
    proc, base, _ = starting
    wait_healthy(proc, base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    return proc, base, client.models.list().data[0].id, client


@pytest.fixture(scope="module")
def browser():
    _chromium_or_skip()
    os.environ["SE_OFFLINE"] = "true"  # selenium must not fetch a driver: it uses the system one
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="tandem-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    metrics = {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # the viewport itself
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate(driver)
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _by_id(driver, id_):
    return driver.find_element("id", id_)


def _send(driver, text: str):
    """Types `text` into the chat and sends it; returns the assistant bubble once it is done."""
    before = len(driver.find_elements("css selector", ".message.assistant"))
    box = _by_id(driver, "chat-input")
    box.clear()
    driver.execute_script("arguments[0].value = arguments[1]", box, text)
    _by_id(driver, "send").click()

    def done(d):
        bubbles = d.find_elements("css selector", ".message.assistant")
        if len(bubbles) > before and bubbles[-1].get_attribute("data-state") != "streaming":
            return bubbles[-1]
        return None

    return _wait(driver, done, what="the streamed answer")


def _rows(driver, selector="#ranks tbody tr[data-rank]"):
    """(data-rank, text) of each row, read in one go: the page re-renders them every second."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map((r) => [r.dataset.rank || '', r.innerText])",
        selector,
    )


def _cluster(base: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{base}/v1/cluster", headers=headers, timeout=10)


def test_page_shows_the_cluster_forming_then_whole(browser, starting):  # browser up first
    _, base, first = starting
    assert first["state"] == "forming" and first["layout"]["world_size"] == 2
    hook = browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_STATES}
    )
    try:
        browser.get(base + "/")
        _wait(browser, lambda d: _by_id(d, "cluster-state").text == "whole", timeout=60)
        states = browser.execute_script("return window.__states")
        assert "forming" in states and states[-1] == "whole", states
        assert states.index("forming") < states.index("whole")
        assert [r for r, _ in _rows(browser)] == ["0", "1"]
    finally:
        browser.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]}
        )
        browser.execute_script("sessionStorage.clear()")


def test_every_route_the_page_uses_refuses_a_missing_or_wrong_key(server):
    _, base, name, _ = server
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    calls = [("GET", "/v1/models", None), ("GET", "/v1/cluster", None)]
    calls += [("POST", "/v1/chat/completions", chat)]
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
        for method, path, body in calls:
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    for method, path, body in calls:
        r = httpx.request(
            method, base + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        assert r.status_code == 200, (path, r.text)
    page = httpx.get(base + "/", timeout=10)  # loads without a key, and tells nothing
    assert page.status_code == 200 and name not in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_page_asks_for_the_key_then_streams_the_api_greedy_answer(server, browser):
    _, base, name, client = server
    browser.get(base + "/")
    _wait(browser, lambda d: _by_id(d, "key-panel").is_displayed(), what="the key panel")
    assert not _by_id(browser, "main").is_displayed()
    _by_id(browser, "key-input").send_keys("wrong-key")
    _by_id(browser, "key-submit").click()
    _wait(browser, lambda d: "refused" in _by_id(d, "key-error").text, what="the refusal")
    _by_id(browser, "key-input").send_keys(KEY)
    _by_id(browser, "key-submit").click()
    _wait(browser, lambda d: _by_id(d, "main").is_displayed(), what="the page behind the key")
    assert _by_id(browser, "model-name").text == name
    _wait(browser, lambda d: _by_id(d, "cluster-state").text == "whole", what="a whole cluster")

    _by_id(browser, "settings").click()
    for id_, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        field = _by_id(browser, id_)
        field.clear()
        field.send_keys(value)
    # every text the answer bubble shows on its way, as the page inserts the deltas
    browser.execute_script(
        """
        window.__shown = [];
        new MutationObserver((records) => {
          for (const r of records) for (const n of r.addedNodes)
            if (n.nodeType === Node.TEXT_NODE) window.__shown.push(n.data);
        }).observe(document.getElementById("messages"), {subtree: true, childList: true});
        """
    )
    reply = _send(browser, QUESTION)
    assert reply.get_attribute("data-state") == "done", _by_id(browser, "chat-error").text
    shown = reply.find_element("css selector", ".text").text

    expected = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    answer = expected.choices[0].message.content
    assert answer.strip() and shown == answer.strip()  # .text drops edge whitespace
    partial = [t for t in browser.execute_script("return window.__shown") if t and t != QUESTION]
    assert partial[-1] == answer
    assert len(set(partial)) >= 3 and all(answer.startswith(t) for t in partial), partial
    assert int(reply.get_attribute("data-deltas")) == len(partial)


def test_cluster_view_lists_both_ranks_with_their_shards(server, browser):
    _, base, _, _ = server
    doc = _cluster(base).json()
    assert doc["layout"] == {"kind": "tp", "tp": 2, "pp": 1, "world_size": 2}
    rows = _wait(browser, _rows, what="the rank rows")  # (rank, text) of each row
    assert [r for r, _ in rows] == ["0", "1"]
    for (_, text), rank in zip(rows, doc["ranks"]):
        s = rank["shard"]
        assert f"kv heads [{s['kv_heads'][0]}, {s['kv_heads'][1]})" in text
        assert f"mlp rows [{s['mlp_rows'][0]}, {s['mlp_rows'][1]})" in text
        assert f"tp {rank['rank']}/2" in text and rank["host"] in text
        assert "50.0 %" in text and "MiB" in text  # its work share, its live memory
    k0, k1 = (r["shard"]["kv_heads"] for r in doc["ranks"])
    assert k0[1] == k1[0]  # the two shards tile the kv heads
    _wait(
        browser,
        lambda d: _by_id(d, "generated").text == str(doc["generated_tokens"]),
        what="the page's next poll",
    )
    links = _rows(browser, "#links tbody tr")
    (link,) = doc["links"]  # measured as the group formed (engine/tp/probe.py)
    assert link["rtt_ms"] > 0 and link["goodput_mbit_s"] > 0
    assert len(links) == 1 and "0 ↔ 1" in links[0][1]
    assert " ms" in links[0][1] and "Mbit/s" in links[0][1] and "—" not in links[0][1]


def test_screenshot_of_the_chat_and_the_cluster_view(server, browser, tmp_path):
    assert _send(browser, FOLLOW_UP).get_attribute("data-state") == "done"
    _wait(
        browser,
        lambda d: (
            _by_id(d, "tokens-per-s").text not in ("—", "") and _by_id(d, "load").text == "0 / 0"
        ),
        what="a tokens/s figure, the answer done",
    )
    browser.execute_script("document.getElementById('settings').open = false; scrollTo(0, 0)")
    out = tmp_path / "web-page.png"
    assert browser.save_screenshot(str(out))
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 1_000_000
    target = os.environ.get("TANDEM_SCREENSHOT")
    if target:
        shutil.copyfile(out, target)


def test_script_in_a_chat_message_is_shown_as_text_not_run(server, browser):
    reply = _send(browser, HOSTILE)
    assert reply.get_attribute("data-state") == "done"
    mine = browser.find_elements("css selector", ".message.user .text")[-1]
    assert mine.text == HOSTILE
    assert browser.execute_script("return [window.__pwned, window.__pwned2]") == [None, None]
    assert not browser.find_elements("css selector", "#messages img, #messages script")


def test_killing_the_worker_turns_the_state_to_failed_within_seconds(server, browser):
    _, base, _, _ = server
    worker = next(r for r in _cluster(base).json()["ranks"] if r["rank"] == 1)
    t0 = time.monotonic()
    os.kill(worker["pid"], signal.SIGKILL)
    _wait(
        browser,
        lambda d: _by_id(d, "cluster-state").text in ("failed", "re-forming"),
        timeout=10,
        what="the failed state",
    )
    assert time.monotonic() - t0 < 5.0
    assert "exited" in _by_id(browser, "cluster-detail").text
    box = _by_id(browser, "chat-input")
    box.send_keys("still there?")
    _by_id(browser, "send").click()
    _wait(browser, lambda d: "not whole" in _by_id(d, "chat-error").text, what="the error")
