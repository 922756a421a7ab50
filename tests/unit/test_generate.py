"""LocalExecutor and the generation loop: cached batched generation equals full recomputation."""

import json
import subprocess
import sys

import pytest
import torch

from tandem.engine.executor import Step, StepSequence
from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor, StepError
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.load import load_model
from tandem.loaders.make import make_model_dir
from tandem.loaders.safetensors_dir import ModelDir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("g") / "tiny-llama"
    make_model_dir(d, "tiny-llama", seed=5)
    return d


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(ModelDir(model_dir))


@torch.inference_mode()
def greedy_by_recompute(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_batched_greedy_generation_equals_full_recomputation(model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 200, 300]]
    ex = LocalExecutor(model, max_batch=4, max_seq_len=64)
    results = generate(ex, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_by_recompute(model, p, 12)
        assert r.finish_reason == "length"
    assert ex.slots._free == [0, 1, 2, 3]  # every finished sequence gave its slot back


def test_seeded_sampling_is_reproducible_and_stops_at_stop_tokens(model):
    ex = LocalExecutor(model, max_batch=2, max_seq_len=64)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    a = generate(ex, [[1, 2, 3]], params)[0].token_ids
    b = generate(ex, [[1, 2, 3]], params)[0].token_ids
    assert a == b
    stop = SamplingParams(
        max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7, stop_token_ids=(a[2],)
    )
    r = generate(ex, [[1, 2, 3]], stop)[0]
    assert r.token_ids == a[: a.index(a[2]) + 1] and r.finish_reason == "stop"


def test_executor_refuses_position_gaps_bad_ids_and_overlong_sequences(model):
    ex = LocalExecutor(model, max_batch=2, max_seq_len=16)
    ex.run(Step((StepSequence(1, (1, 2, 3), 0),)))
    with pytest.raises(StepError, match="start_pos 5"):
        ex.run(Step((StepSequence(1, (4,), 5),)))
    with pytest.raises(StepError, match="token id"):
        ex.run(Step((StepSequence(2, (9999,), 0),)))
    with pytest.raises(ValueError, match="max_seq_len"):
        ex.run(Step((StepSequence(1, tuple(range(14)), 3),)))
    with pytest.raises(StepError, match="1..2 sequences"):
        ex.run(Step(tuple(StepSequence(i, (1,), 0) for i in range(3))))
    # a rewind (re-prefill from an earlier position) is allowed and overwrites the cache
    out = ex.run(Step((StepSequence(1, (1, 2, 3), 0),))).logits
    assert out.shape == (1, ex.vocab_size) and out.dtype == torch.float32


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tandem", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_cli_json_reports_ids_text_and_speeds(model_dir, model):
    out = run_cli(
        "--model",
        str(model_dir),
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
        "--ignore-eos",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["token_ids"] == greedy_by_recompute(model, [5, 6, 7], 6)
    assert isinstance(res["text"], str)
    assert res["ttft_s"] > 0 and res["prefill_tok_s"] > 0 and res["decode_tok_s"] > 0
    streamed = run_cli(
        "--model", str(model_dir), "--prompt", "Hello world", "--max-tokens", "4", "--chat"
    )
    assert streamed.returncode == 0, streamed.stderr
    assert "decode" in streamed.stderr


def test_text_prompt_without_tokenizer_is_refused_with_a_clear_message(tmp_path):
    make_model_dir(tmp_path / "u", "tiny-qwen3-untied", seed=0)
    out = run_cli("--model", str(tmp_path / "u"), "--prompt", "hi")
    assert out.returncode == 2 and "--prompt-ids" in out.stderr
