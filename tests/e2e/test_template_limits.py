"""A GGUF whose chat template is a bomb (three nested `range(100000)` loops writing every index)
against a real `tandem serve`: the request is a 400 naming the template's output limit within
seconds, the server's memory stays flat and it answers the next chat; a file whose template
bombs on every conversation is refused at start, naming the limit."""

import json
import threading
import time
import urllib.error
import urllib.request

import psutil
from serve_support import TANDEM, output, running, spawn

from tandem.cluster.launcher import free_ports
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.tokenizer_build import CHATML_TEMPLATE

BOMB = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
    "{{ k }}{% endfor %}{% endfor %}{% endfor %}"
)
ON_BOOM = "{% if messages[-1]['content'] == 'boom' %}" + BOMB + "{% endif %}" + CHATML_TEMPLATE
# the sandbox's address-space cap (512 MiB) is the most its process can take
TREE_GROWTH_BOUND = 640 << 20


def _gguf(tmp_path_factory, template: str):
    out = tmp_path_factory.mktemp("g") / "bomb.gguf"
    _, (f,) = write_preset_gguf(out, "tiny-qwen3", "Q8_0", chat_template=template)
    return f


def _tree_rss(pid: int) -> int:
    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


class PeakRSS(threading.Thread):
    """The largest RSS of a process tree, sampled every 50 ms until `stop()`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._halt = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.05):
            self.peak = max(self.peak, _tree_rss(self.pid))

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def _chat(base: str, content: str) -> tuple[int, dict]:
    body = {"model": "bomb", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_template_bomb_is_a_400_naming_the_limit_with_the_memory_flat(tmp_path_factory):
    gguf = _gguf(tmp_path_factory, ON_BOOM)
    with running(["serve", "--model", str(gguf)]) as (proc, base):
        assert _chat(base, "hello")[0] == 200  # the sandbox started and warm
        server, before = psutil.Process(proc.pid), _tree_rss(proc.pid)
        head_before = server.memory_info().rss
        peak = PeakRSS(proc.pid)
        peak.start()
        t0 = time.monotonic()
        status, body = _chat(base, "boom")
        took = time.monotonic() - t0
        grew = peak.stop() - before
        assert status == 400, body
        assert body["error"]["code"] == "chat_template_limit"
        assert body["error"]["param"] == "messages"
        assert "output limit" in body["error"]["message"], body
        assert took < 15
        assert grew < TREE_GROWTH_BOUND, grew
        assert server.memory_info().rss - head_before < 32 << 20
        status, body = _chat(base, "hello")  # a fresh sandbox; the server serves on
        assert status == 200 and body["choices"][0]["message"]["content"] is not None
        assert _tree_rss(proc.pid) - before < 64 << 20


def test_a_template_that_bombs_on_the_probe_is_refused_at_start(tmp_path_factory):
    gguf = _gguf(tmp_path_factory, BOMB)
    (port,) = free_ports(1)
    proc = spawn([*TANDEM, "serve", "--model", str(gguf), "--port", str(port)])
    peak = PeakRSS(proc.pid)
    peak.start()
    try:
        code = proc.wait(60)
    except Exception:
        proc.kill()
        raise
    finally:
        top = peak.stop()
    text = output(proc)
    assert code != 0
    assert "chat template went past its output limit" in text, text[-2000:]
    assert top < 700 << 20, top
