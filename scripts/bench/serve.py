"""Aggregate serving throughput: 8 concurrent OpenAI clients vs one, against one live `tandem serve`.

    .venv/bin/python scripts/bench/serve.py [--model DIR | --preset tiny-qwen3] [--tp 1] [--clients 8]
                                    [--requests 2] [--max-tokens 32]

Starts a real server process, warms it up, then in the same run: one client sends `clients x
requests` chat requests one after another; then `clients` clients send `requests` each at once.
Every request generates exactly `max_tokens` tokens (ignore_eos), greedy. Prints both tokens/s,
the ratio, and latency figures, as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.cluster.launcher import ProcessGroup, RankProcess, free_ports  # noqa: E402

PROMPTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over",
    "Once upon a time there was a little robot",
    "def generate(model, prompt, max_tokens=16):",
    "Numbers: 0 1 2 3 4 5 6 7 8 9",
    "The sun rose over the hills and",
    "One language model spread across a laptop",
    "Every morning it read a book, and",
]


def wait_up(base: str, group: ProcessGroup, timeout_s: float = 600) -> None:
    """Until `base`/health answers 200; exits if the server dies or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if group.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not come up")


def _one(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[int, float, float]:
    """(completion tokens, time to first token, total seconds) of one streamed request."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return tokens, ttft if ttft is not None else total, total


def _phase(client, model, prompts_per_client: list[list[str]], max_tokens: int) -> dict:
    def worker(prompts):
        return [_one(client, model, p, max_tokens) for p in prompts]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts_per_client)) as pool:
        results = [r for rs in pool.map(worker, prompts_per_client) for r in rs]
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {
        "clients": len(prompts_per_client),
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "ttft_median_s": round(statistics.median(r[1] for r in results), 4),
        "request_latency_median_s": round(statistics.median(r[2] for r in results), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model")
    src.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        model = str(Path(tmp.name) / args.preset)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem",
                "make-model",
                model,
                "--preset",
                args.preset,
                "--seed",
                "0",
            ],
            check=True,
            cwd=ROOT,
        )
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "tandem", "serve", "--model", model, "--port", str(port)]
    argv += ["--tp", str(args.tp), "--pp", str(args.pp), "--dtype", args.dtype]
    argv += ["--max-batch", str(max(8, args.clients))]
    base = f"http://127.0.0.1:{port}"
    with ProcessGroup([RankProcess("serve", argv, {"PYTHONPATH": str(ROOT)})]) as group:
        wait_up(base, group)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        _one(client, name, PROMPTS[0], 4)  # warm-up
        n = args.clients * args.requests
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        single = _phase(client, name, [prompts], args.max_tokens)
        split = [prompts[c :: args.clients] for c in range(args.clients)]
        concurrent = _phase(client, name, split, args.max_tokens)
    result = {
        "model": name,
        "tp": args.tp,
        "pp": args.pp,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "one_client": single,
        "concurrent": concurrent,
        "aggregate_speedup": round(concurrent["tok_s"] / single["tok_s"], 2),
    }
    print(f"one client:  {single['tok_s']:8.2f} tok/s  ({single['requests']} requests in sequence)")
    print(f"{args.clients} clients:   {concurrent['tok_s']:8.2f} tok/s  (same requests, at once)")
    print(f"aggregate speedup: {result['aggregate_speedup']}x")
    print(json.dumps(result))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
