"""A long prefill under `tandem serve --pp 2` is not taken for a hang: a 4,000-token prompt keeps
the head and the stage process computing for several times the heartbeat timeout
(`--heartbeat-timeout 2`, op timeout 60 s), and `/health` stays 200 throughout (polled every
0.05 s), the request completes, and `/metrics` counts no group failure. The scheduler prefills at
most 512 prompt tokens a step, so the prompt is eight steps back to back; the single 4,000-token
step, the worst case for a heartbeat that waited on the compute, is
`tests/distributed/test_heartbeat_pp.py::test_a_long_prefill_is_not_taken_for_a_hang`.
Real processes on loopback."""

import json
import threading
import time
import urllib.request
from dataclasses import replace

import pytest
import torch
from serve_support import health, metric, running

from tandem.bench.fault_drill import served_model
from tandem.loaders.make import make_model_dir
from tandem.models.presets import get_preset

HEARTBEAT_S = 2
PROMPT_TOKENS = 4000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny Llama widened and deepened (bfloat16, 4,096 positions) so that a 4,000-token
    prefill takes seconds even on a fast, quiet core."""
    cfg = replace(
        get_preset("tiny-llama").config, hidden_size=512, intermediate_size=1536,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=32,
        max_position_embeddings=4096,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("long-prefill") / "model"
    make_model_dir(out, "tiny-llama", seed=0, config=cfg, dtype=torch.bfloat16)
    return out, cfg


@pytest.mark.slow
def test_a_4000_token_prompt_under_serve_pp2_leaves_health_200_throughout(long_model):
    model, cfg = long_model
    args = ["serve", "--model", str(model), "--pp", "2", "--max-batch", "1"]
    limits = [
        "--max-seq-len",
        "4096",
        "--op-timeout",
        "60",
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
    ]
    with running([*args, *limits]) as (_, base):
        failures = metric(base, "tandem_group_failures_total")
        codes: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                codes.append(health(base))

        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()
        body = json.dumps(
            {"model": served_model(base), "prompt": prompt, "max_tokens": 2, "temperature": 0}
        )
        req = urllib.request.Request(
            f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                answer = json.loads(r.read())
        finally:
            took = time.monotonic() - t0
            stop.set()
            watcher.join()
        assert took > 2 * HEARTBEAT_S, f"the prefill took {took:.1f} s: too short to prove anything"
        assert answer["usage"]["prompt_tokens"] == PROMPT_TOKENS
        assert answer["usage"]["completion_tokens"] == 2
        assert codes and set(codes) == {200}, sorted(set(codes))
        assert metric(base, "tandem_group_failures_total") == failures
        print(f"4,000-token prompt: {took:.1f} s, {len(codes)} /health polls, every one 200")
