"""Ollama's API over the executor double, spoken by the official `ollama` client against a real
uvicorn: list, show, ps, version, chat and generate streamed and not (the same text as the OpenAI
route's), the options it maps, `format` and the other fields tandem does not honour refused with
Ollama's `{"error": ...}`, the API key, and the routes while the group forms."""

import httpx
import ollama
import pytest
from _serving_doubles import CharTokenizer, HistoryExecutor
from fastapi.testclient import TestClient
from http_server_support import running_server

from tandem.engine.scheduler import Scheduler
from tandem.engine.serving import ServingEngine
from tandem.server.app import create_app
from tandem.server.forming import create_forming_app

MODEL = "tiny-test"
KEY = "sekrit"


@pytest.fixture(scope="module")
def served():
    ex = HistoryExecutor(vocab=128, span=26, offset=97, max_seq_len=64)
    sched = Scheduler(ex)
    sched.start()
    app = create_app(ServingEngine(sched, CharTokenizer(), MODEL), api_key=KEY)
    with running_server(app) as port:
        base = f"http://127.0.0.1:{port}"
        client = ollama.Client(host=base, headers={"Authorization": f"Bearer {KEY}"})
        yield base, client
    sched.stop()


def _openai_text(base, **body):
    body = {"model": MODEL, "temperature": 0, **body}
    r = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    return r.json()["choices"][0]["message"]["content"]


def test_list_show_ps_and_version_describe_the_one_model(served):
    base, client = served
    (m,) = client.list().models
    assert m.model == f"{MODEL}:latest"
    shown = client.show(MODEL)
    assert shown.modelinfo["general.context_length"] == 64 and "completion" in shown.capabilities
    assert "temperature" in shown.parameters
    (p,) = client.ps().models
    assert p.model == f"{MODEL}:latest" and p.context_length == 64
    assert httpx.get(f"{base}/api/version").json()["version"]


def test_chat_streamed_and_not_gives_the_openai_route_s_greedy_text(served):
    base, client = served
    messages = [{"role": "user", "content": "hi"}]
    want = _openai_text(base, messages=messages, max_tokens=10)
    r = client.chat(
        model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 10}, stream=False
    )
    assert r.message.role == "assistant" and r.message.content == want
    assert r.done and r.done_reason == "length" and r.eval_count == 10 and r.prompt_eval_count > 0
    parts = list(
        client.chat(
            model=f"{MODEL}:latest",
            messages=messages,
            options={"temperature": 0, "num_predict": 10},
            stream=True,
        )
    )
    assert "".join(p.message.content for p in parts) == want
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_duration >= 0


def test_generate_templates_the_prompt_unless_raw_and_returns_its_context(served):
    base, client = served
    want = _openai_text(base, messages=[{"role": "user", "content": "abc"}], max_tokens=6)
    opts = {"temperature": 0, "num_predict": 6}
    r = client.generate(model=MODEL, prompt="abc", options=opts, stream=False)
    assert r.response == want and r.done
    raw = client.generate(model=MODEL, prompt="abc", raw=True, options=opts, stream=False)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0}
    completion = httpx.post(
        f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert raw.response == completion.json()["choices"][0]["text"]
    assert list(raw.context) == [ord(c) for c in "abc" + raw.response]
    more = client.generate(
        model=MODEL, prompt="d", raw=True, context=raw.context, options=opts, stream=False
    )
    again = client.generate(
        model=MODEL, prompt="abc" + raw.response + "d", raw=True, options=opts, stream=False
    )
    assert more.response == again.response  # the context is the earlier exchange's tokens
    streamed = list(client.generate(model=MODEL, prompt="abc", options=opts, stream=True))
    assert "".join(p.response for p in streamed) == want and streamed[-1].context
    loaded = client.generate(model=MODEL)  # no prompt: Ollama's way of loading a model
    assert loaded.done and loaded.done_reason == "load"


def test_options_map_onto_the_sampling_controls(served):
    _, client = served
    greedy = {"temperature": 0, "num_predict": 12}
    plain = client.generate(
        model=MODEL, prompt="q", raw=True, options={**greedy, "repeat_penalty": 1.0}
    ).response
    assert len(set(plain)) < len(plain)  # the double repeats itself greedily
    pen = client.generate(
        model=MODEL,
        prompt="q",
        raw=True,
        options={**greedy, "presence_penalty": 2.0, "repeat_penalty": 1.0},
    ).response
    assert len(set(pen)) == len(pen)
    stopped = client.generate(
        model=MODEL, prompt="q", raw=True, options={**greedy, "stop": [plain[3:5]]}
    )
    assert stopped.response == plain[: plain.index(plain[3:5])] and stopped.done_reason == "stop"
    seeded = {"temperature": 1.0, "seed": 9, "num_predict": 8, "top_k": 0, "top_p": 1.0}
    a = client.generate(model=MODEL, prompt="q", raw=True, options=seeded).response
    assert a == client.generate(model=MODEL, prompt="q", raw=True, options=seeded).response
    short = client.generate(model=MODEL, prompt="q", raw=True, options={**greedy, "num_ctx": 4})
    assert len(short.response) == 3  # prompt + output within num_ctx
    hints = {
        **greedy,
        "num_thread": 2,
        "num_gpu": 0,
        "use_mmap": True,
        "mirostat": 0,
        "typical_p": 1.0,
    }
    same = client.generate(model=MODEL, prompt="q", raw=True, options=greedy).response
    assert client.generate(model=MODEL, prompt="q", raw=True, options=hints).response == same


def test_repeat_penalty_and_repeat_last_n_reach_the_logits(served):
    """The double's top logit is 0, which a repetition penalty leaves; the runners-up (negative)
    among the window's tokens are multiplied by it, as the logprobs show."""
    _, client = served

    def top(**options):
        r = client.generate(
            model=MODEL, prompt="abcdefghijklmnopqrstuvwxyz", raw=True, logprobs=True, top_logprobs=3,
            options={"temperature": 0, "num_predict": 1, **options},
        )  # fmt: skip
        return [(t.token, t.logprob) for t in r.logprobs[0].top_logprobs]

    off = top(repeat_penalty=1.0)
    assert top(repeat_penalty=2.0) != off
    assert top(repeat_penalty=2.0, repeat_last_n=0) == off  # 0: no repetition penalty
    assert top() == top(repeat_penalty=1.1, repeat_last_n=64)  # Ollama's defaults


def test_logprobs_come_with_each_piece(served):
    _, client = served
    r = client.chat(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"temperature": 0, "num_predict": 4},
        logprobs=True, top_logprobs=2, stream=False,
    )  # fmt: skip
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    assert all(lp.top_logprobs[0].token == lp.token for lp in r.logprobs)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"format": {"type": "no-such-type"}}, "format"),
        ({"think": True}, "think"),
        ({"options": {"mirostat": 2}}, "mirostat"),
        ({"options": {"no_such_option": 1}}, "no_such_option"),
        ({"options": {"temperature": -1}}, "temperature"),
    ],
)
def test_fields_tandem_does_not_honour_are_an_ollama_error_naming_them(served, kw, field):
    _, client = served
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=False, **kw)
    assert e.value.status_code == 400 and field in e.value.error


def test_unknown_model_missing_key_and_images_are_ollama_errors(served):
    base, client = served
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "llama3" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).list()
    assert e.value.status_code == 401 and e.value.error == "Incorrect API key provided."
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "images" in e.value.error


def test_while_the_group_forms_the_ollama_routes_answer_503_in_ollama_s_shape():
    app = create_forming_app(MODEL, tp=2, pp=1, api_key=KEY)
    with TestClient(app) as c:
        assert c.get("/api/tags").status_code == 401
        r = c.post("/api/chat", json={"model": MODEL}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and "forming" in r.json()["error"]
