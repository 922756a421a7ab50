"""`tandem serve --model FILE.gguf` answers the official `openai` client: the tokenizer and chat
template come from the file, the weights stay in their blocks, and the text is the in-process
reference's greedy continuation."""

import openai
import pytest
from serve_support import running

from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.gguf.model_file import GGUFModel
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    _, (f,) = write_preset_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", "tiny-qwen3", "Q8_0")
    return f


@pytest.fixture(scope="module")
def server(gguf):
    args = ["serve", "--model", str(gguf), "--tp", "1", "--max-batch", "4"]
    with running(args) as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def reference_text(gguf, prompt: str, n: int) -> str:
    src = GGUFModel(gguf)
    tok = src.tokenizer()
    ids = tok.encode(prompt)
    ex = LocalExecutor(load_model(src), max_batch=1, max_seq_len=len(ids) + n)
    stop = tuple(src.config.eos_token_ids) + tuple(tok.eos_token_ids)
    (res,) = generate(ex, [ids], SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=stop))
    return tok.decode([t for t in res.token_ids if t not in stop])


def test_openai_client_completion_on_a_gguf_is_the_reference_continuation(server, gguf):
    (model,) = server.models.list().data
    assert model.id == "tiny"
    r = server.completions.create(model=model.id, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == reference_text(gguf, PROMPT, 8)
    assert r.usage.completion_tokens >= 1


def test_openai_client_chat_on_a_gguf_streams_what_it_answers(server):
    name = server.models.list().data[0].id
    msgs = [{"role": "user", "content": PROMPT}]
    whole = server.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0)
    text = whole.choices[0].message.content
    assert isinstance(text, str) and whole.usage.prompt_tokens > 3
    stream = server.chat.completions.create(
        model=name, messages=msgs, max_tokens=10, temperature=0, stream=True
    )
    parts = [c.delta.content or "" for chunk in stream for c in chunk.choices]
    assert "".join(parts) == text
