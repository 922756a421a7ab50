"""A chat template renders in its own process under a time, output and memory bound: each bound
is a typed error naming it, this process's memory does not move, a process stuck past its timer
is killed at the bound, and the next render gets a fresh process."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from fastapi.testclient import TestClient

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.loaders.chat_template import GRACE_S, TemplateLimits, TemplateRenderer
from tandem.loaders.errors import ChatTemplateError, ChatTemplateRefused, TemplateLimitError
from tandem.loaders.tokenizer import Tokenizer
from tandem.loaders.tokenizer_build import build_byte_bpe
from tandem.server.app import create_app

LIMITS = TemplateLimits(seconds=1.0, output_chars=1 << 20, memory_bytes=256 << 20)
CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ bos_token }}"
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
BOMBS = {
    # the bomb: three nested range(100000) loops writing every index
    "output": NESTED + "{{ k }}{% endfor %}{% endfor %}{% endfor %}",
    "time": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # a string doubled in a namespace: no output, no long loop, gigabytes
    "memory": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
}
HI = [{"role": "user", "content": "hi"}]


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _render(template: str, messages=HI, limits=LIMITS) -> str:
    r = TemplateRenderer(template, {"bos_token": "<s>"}, "model.gguf", limits)
    try:
        return r.render(messages, True, {})
    finally:
        r.close()


def test_a_template_within_its_bounds_renders_as_before():
    assert _render(CHAT) == "<user>hi<s>"


@pytest.mark.parametrize("limit", sorted(BOMBS))
def test_each_bound_is_a_typed_error_naming_it_and_this_process_stays_flat(limit):
    """The output and memory bombs run under a 30 s timer, so a loaded machine's slow start
    cannot make the time bound trip before theirs."""
    limits = LIMITS if limit == "time" else replace(LIMITS, seconds=30.0)
    before, t0 = _rss(), time.monotonic()
    with pytest.raises(TemplateLimitError) as e:
        _render(BOMBS[limit], limits=limits)
    assert e.value.limit == limit
    assert f"{limit} limit" in str(e.value) and "model.gguf" in str(e.value)
    assert time.monotonic() - t0 < limits.seconds + GRACE_S + 2
    assert _rss() - before < 16 << 20


def test_a_huge_constant_is_refused_by_the_memory_bound():
    with pytest.raises(TemplateLimitError) as e:
        _render("{{ 'a' * 10 ** 10 }}")
    assert e.value.limit == "memory"


def test_a_process_stuck_past_its_timer_is_killed_at_the_bound():
    """A SIGSTOPped sandbox handles no timer, like one inside a C call: the parent stops
    waiting at the time bound plus its grace and kills it."""
    r = TemplateRenderer(BOMBS["time"], {}, "model.gguf", LIMITS)
    r._ensure_started()  # started by the first render otherwise: started now, to be stopped
    pid = r._proc.pid
    threading.Timer(0.2, os.kill, (pid, signal.SIGSTOP)).start()
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError) as e:
        r.render(HI, True, {})
    assert e.value.limit == "time"
    assert time.monotonic() - t0 < LIMITS.seconds + GRACE_S + 1
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_after_a_limit_the_next_render_gets_a_fresh_process_and_succeeds():
    template = "{% if messages[0].content == 'boom' %}" + BOMBS["output"] + "{% endif %}" + CHAT
    r = TemplateRenderer(template, {"bos_token": "<s>"}, "model.gguf", LIMITS)
    try:
        r._ensure_started()
        first = r._proc.pid
        with pytest.raises(TemplateLimitError):
            r.render([{"role": "user", "content": "boom"}], True, {})
        assert r.render(HI, True, {}) == "<user>hi<s>"
        assert r._proc.pid != first
    finally:
        r.close()


def test_a_refusal_and_a_syntax_error_are_typed_and_not_limits():
    with pytest.raises(ChatTemplateRefused, match="no system role"):
        _render("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="model.gguf: chat template failed") as e:
        _render("{% for %}")
    assert not isinstance(e.value, TemplateLimitError)


def _tokenizer(template: str) -> Tokenizer:
    tok = Tokenizer(build_byte_bpe(64), {"chat_template": template}, Path("model"))
    tok.template_limits = LIMITS
    return tok


def test_the_probe_at_load_refuses_a_bomb_and_leaves_a_refusal_to_the_requests():
    with pytest.raises(TemplateLimitError, match="output limit"):
        _tokenizer(BOMBS["output"]).check_chat_template()
    _tokenizer("{{ raise_exception('odd roles') }}").check_chat_template()
    ok = _tokenizer(CHAT)
    ok.check_chat_template()
    assert ok.apply_chat_template(HI) == "<user>hi"
    ok.close()


def test_the_api_answers_a_template_past_its_limit_with_a_400_naming_it():
    r = TemplateRenderer(BOMBS["output"], {}, "model.gguf", LIMITS)
    sched = Scheduler(HistoryExecutor(vocab=128, span=26, offset=97))
    sched.start()
    engine = ServingEngine(
        sched, CharTokenizer(), "m", chat_template=lambda m: r.render(m, True, {})
    )
    try:
        with TestClient(create_app(engine)) as c:
            body = {"model": "m", "messages": HI, "max_tokens": 2}
            resp = c.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["code"] == "chat_template_limit" and err["param"] == "messages"
            assert "output limit (1048576 characters)" in err["message"]
            assert c.get("/health").status_code == 200
    finally:
        sched.stop()
        r.close()


def test_limits_given_to_launch_reach_serve_bound_the_render_and_the_400_names_the_set_value():
    """`launch --template-output-limit 4000 --template-time-limit 2` reaches the `tandem serve` it
    runs; there a template writing 5,000 characters (within the default 8 Mi) is answered 400
    naming the limit as set, and the probe at start refuses it too. Flags left out keep their
    documented defaults; a non-positive one is refused by the parser."""
    from tandem.cli.launch import serve_argv
    from tandem.cli.main import build_parser
    from tandem.cli.serve import template_limits

    parser = build_parser()
    given = ["--template-output-limit", "4000", "--template-time-limit", "2"]
    launched = parser.parse_args(["launch", *given])
    served = parser.parse_args(serve_argv(launched, Path("m.gguf"))[3:])
    limits = template_limits(served)
    assert limits == TemplateLimits(seconds=2.0, output_chars=4000)  # memory at its default
    assert template_limits(parser.parse_args(["serve"])) == TemplateLimits()
    for flag, bad in (("--template-time-limit", "0"), ("--template-output-limit", "-5")):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, bad])

    five_thousand = "{% for i in range(1000) %}{{ '12345' }}{% endfor %}"
    tok = Tokenizer(build_byte_bpe(64), {"chat_template": five_thousand}, Path("model"))
    assert len(tok.apply_chat_template(HI)) == 5000  # the default output limit lets it through
    tok.template_limits = limits
    with pytest.raises(TemplateLimitError, match=r"output limit \(4000 characters\)"):
        tok.check_chat_template()
    sched = Scheduler(HistoryExecutor(vocab=128, span=26, offset=97))
    sched.start()
    engine = ServingEngine(sched, CharTokenizer(), "m", chat_template=tok.apply_chat_template)
    try:
        with TestClient(create_app(engine)) as c:
            resp = c.post("/v1/chat/completions", json={"model": "m", "messages": HI})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["code"] == "chat_template_limit" and err["param"] == "messages"
            assert "output limit (4000 characters)" in err["message"]
    finally:
        sched.stop()
        tok.close()
