"""Decode speed with a JSON schema against without, on a live `tandem serve`.

    .venv/bin/python scripts/bench/structured_decode.py [--model FILE.gguf] [--rounds 5]
        [--max-tokens 64] [--layouts single,tp2]

For each layout (`single`: one node; `tp2`: `serve --tp 2`) it starts one server and sends, in
alternation, `rounds` pairs of streamed chat requests for `max_tokens` tokens each: one plain
(EOS ignored) and one under `response_format` json_schema (a schema whose shortest answer is
longer than `max_tokens`, so both run to the limit: the grammar's mask applied at every step).
A request's decode rate is (completion tokens - 1) / (time of the last chunk - time of the
first). Prints each layout's median rates and their ratio (schema / plain, target >= 0.9), and
the whole result as JSON on the last line. Default model: SmolLM2-135M-Instruct Q4_1.
"""

from __future__ import annotations

import argparse
import json
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
# at least 60 notes: no answer ends before 64 tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "notes": {
            "type": "array",
            "items": {"type": "string", "minLength": 2, "maxLength": 40},
            "minItems": 60,
        },
    },
    "required": ["title", "notes"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Write notes about a trip to the mountains as JSON."}]


def _one(client: openai.OpenAI, model: str, max_tokens: int, schema: bool) -> dict:
    extra: dict = {"ignore_eos": True} if not schema else {}
    fmt = {"type": "json_schema", "json_schema": {"name": "notes", "schema": SCHEMA}}
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        response_format=fmt if schema else openai.NOT_GIVEN,
        extra_body=extra,
    )
    first = last = None
    usage = None
    for chunk in stream:
        if any(c.delta.content for c in chunk.choices):
            last = time.perf_counter()
            first = first or last
        usage = chunk.usage or usage
    tokens = usage.completion_tokens
    rate = (tokens - 1) / (last - first) if first and last and last > first else 0.0
    return {"tokens": tokens, "ttft_s": round(first - t0, 4), "tok_s": round(rate, 2)}


def run(model_path: str, layout: str, args: argparse.Namespace) -> dict:
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "tandem", "serve", "--model", model_path, "--port", str(port)]
    argv += ["--max-batch", "2", *LAYOUTS[layout]]
    base = f"http://127.0.0.1:{port}"
    with ProcessGroup([RankProcess("serve", argv, {"PYTHONPATH": str(ROOT)})]) as group:
        wait_up(base, group, timeout_s=900)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="bench", max_retries=0, timeout=900)
        name = client.models.list().data[0].id
        _one(client, name, 8, False)  # warm: the first request builds what later ones reuse
        _one(client, name, 8, True)  # and the grammar's vocabulary
        plain, schema = [], []
        for k in range(args.rounds):
            for wanted, out in ((False, plain), (True, schema)):
                r = _one(client, name, args.max_tokens, wanted)
                out.append(r)
                kind = "schema" if wanted else "plain"
                print(f"  {layout} round {k + 1} {kind}: {r}", file=sys.stderr, flush=True)
    p = statistics.median(r["tok_s"] for r in plain)
    s = statistics.median(r["tok_s"] for r in schema)
    return {"plain": plain, "schema": schema, "plain_median_tok_s": p,
            "schema_median_tok_s": s, "ratio": round(s / p, 3)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 Q4_1 if installed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layouts", default="single,tp2")
    args = ap.parse_args()
    model = args.model or str(default_model()[0])
    result: dict = {"model": Path(model).name, "max_tokens": args.max_tokens, "layouts": {}}
    for layout in args.layouts.split(","):
        r = run(model, layout, args)
        result["layouts"][layout] = r
        print(
            f"{layout}: plain {r['plain_median_tok_s']:.1f} tok/s, json_schema "
            f"{r['schema_median_tok_s']:.1f} tok/s, ratio {r['ratio']:.3f} "
            f"(medians of {args.rounds}, {args.max_tokens} tokens each)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
