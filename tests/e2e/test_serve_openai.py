"""The official `openai` client against a live `tandem serve` (real processes, real sockets)."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from serve_support import get_json, make_model, metric, running
from serve_support import health as get_status

TP = int(os.environ.get("TANDEM_TEST_SERVE_TP", "2"))
KEY = "right-key"

PROMPTS = [
    "Hello, world!",
    "The quick brown fox",
    "Once upon a time",
    "def generate(model, prompt):",
    "Numbers: 0 1 2 3",
    "The sun rose over the hills",
    "One language model spread across",
    "How are you today?",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("serve") / "model")


@pytest.fixture(scope="module")
def server(model):
    args = ["serve", "--model", str(model), "--tp", str(TP), "--max-batch", "8"]
    with running(args, env={"TANDEM_API_KEY": KEY}) as (proc, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        yield proc, base, name, client


def _chat(client, name, prompt, **kw):
    return client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": prompt}], temperature=0, **kw
    )


def test_openai_client_gets_a_chat_completion(server):
    _, _, name, client = server
    r = _chat(client, name, "Hello, world!", max_tokens=10)
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 3
    assert r.model == name


def test_openai_client_streamed_chat_equals_the_non_streamed_one(server):
    _, _, name, client = server
    whole = _chat(client, name, "Once upon a time", max_tokens=12).choices[0].message.content
    stream = _chat(client, name, "Once upon a time", max_tokens=12, stream=True)
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole
    assert reasons[-1] in ("stop", "length")


def test_text_completions_and_models_endpoints(server):
    _, _, name, client = server
    assert [m.id for m in client.models.list().data] == [name]
    r = client.completions.create(
        model=name, prompt="The quick brown fox", max_tokens=6, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 6


def test_llamacpp_native_completion_streamed_and_not_over_httpx(server):
    # llama.cpp's /completion as its clients call it: a plain HTTP client, SSE `data:` lines
    _, base, name, client = server
    want = client.completions.create(
        model=name, prompt="Once upon a time", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=auth, timeout=120) as http:
        whole = http.post("/completion", json=body).json()
        assert (whole["content"], whole["stop_type"], whole["tokens_predicted"]) == (
            want,
            "limit",
            8,
        )
        with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
        assert "".join(e["content"] for e in events) == want
        assert [e["stop"] for e in events][-2:] == [False, True]
        ids = http.post("/tokenize", json={"content": want}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == want


def test_eight_concurrent_clients_share_steps_and_match_one_at_a_time(server):
    _, base, name, client = server
    alone = [_chat(client, name, p, max_tokens=12).choices[0].message.content for p in PROMPTS]
    steps0, toks0 = (
        metric(base, "tandem_steps_total"),
        metric(base, "tandem_generation_tokens_total"),
    )
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _chat(client, name, p, max_tokens=12), PROMPTS))
    steps = metric(base, "tandem_steps_total") - steps0
    tokens = metric(base, "tandem_generation_tokens_total") - toks0
    assert [r.choices[0].message.content for r in together] == alone
    assert len(set(alone)) > 1  # independent completions, not one answer copied
    assert steps < tokens  # decode steps were shared, not one request at a time


def test_openai_style_errors_for_unknown_model_negative_max_tokens_and_long_prompt(server):
    _, _, name, client = server
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, "no-such-model", "hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, name, "hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, name, "hello " * ctx, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"


def test_server_binds_loopback_by_default(server):
    proc, _, _, _ = server
    listening = [
        c.laddr
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening


def test_wrong_api_key_gets_401_and_health_and_metrics_stay_open(server):
    _, base, _, _ = server
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert get_json(f"{base}/health")["status"] == "ok"
    assert metric(base, "tandem_healthy") == 1


def test_metrics_report_time_in_collectives_and_bytes_on_the_wire(server):
    _, base, name, client = server
    _chat(client, name, "Hello, world!", max_tokens=4)
    if TP > 1:
        assert metric(base, "tandem_collective_seconds_total") > 0
        assert metric(base, "tandem_wire_bytes_total") > 0


def test_a_pipeline_server_gives_the_same_greedy_chat_as_the_tensor_parallel_one(server, model):
    """Concurrent requests over `--pp 2` run as one group per stage in flight (submit/collect)."""
    _, _, name, client = server
    want = [_chat(client, name, p, max_tokens=8).choices[0].message.content for p in PROMPTS[:4]]
    with running(["serve", "--model", str(model), "--pp", "2"]) as (_, base):
        pp = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _chat(pp, name, p, max_tokens=8), PROMPTS[:4]))
        assert metric(base, "tandem_wire_bytes_total") > 0
    assert [r.choices[0].message.content for r in got] == want


def test_health_turns_503_when_a_worker_dies_and_requests_get_an_openai_error(model):
    if TP < 2:
        pytest.skip("needs a worker rank")
    # --reform-timeout 0: the first loss ends the group (test_serve_recovery.py: the default)
    args = ["serve", "--model", str(model), "--tp", str(TP), "--reform-timeout", "0"]
    with running(args) as (proc, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        _chat(client, name, "Hello", max_tokens=2)
        workers = [
            c for c in psutil.Process(proc.pid).children(recursive=True) if "worker" in c.cmdline()
        ]
        assert workers
        workers[0].kill()
        deadline = time.time() + 60
        while get_status(base) != 503 and time.time() < deadline:
            time.sleep(0.5)
        assert get_status(base) == 503
        with pytest.raises(openai.InternalServerError) as e:
            _chat(client, name, "Hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable"
