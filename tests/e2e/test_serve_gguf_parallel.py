"""`tandem serve --model FILE.gguf` with `--tp 2` and with `--pp 2` answers the official `openai`
client, each rank or stage holding only its part of the file's blocks, and both give the same
greedy completion (float32 ranks)."""

import openai
import pytest
from serve_support import running_all

from tandem.loaders.gguf.writer import write_preset_gguf

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-gguf")
    _, (f,) = write_preset_gguf(d / "tiny.gguf", "tiny-qwen3", "Q8_0", seed=2)
    return f


def _complete(base: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    return client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)


def test_serve_a_gguf_file_at_tp2_and_pp2_answers_the_openai_client_alike(gguf):
    texts = []
    layouts = (["--tp", "2", "--dtype", "float32"], ["--pp", "2"])
    with running_all(*(["serve", "--model", str(gguf), *layout] for layout in layouts)) as up:
        for _, base in up:
            r = _complete(base)
            assert r.choices[0].finish_reason in ("stop", "length")
            assert 1 <= r.usage.completion_tokens <= 8
            texts.append(r.choices[0].text)
    assert texts[0] == texts[1]
