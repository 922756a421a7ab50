"""What a JSON schema's token mask costs a decode step, in process, with the mask computed ahead
(beside the step, `tandem.engine.grammar`) and computed when asked (after the step, on the head).

    PYTHONPATH=. .venv/bin/python scripts/bench/grammar_overlap.py [--model FILE.gguf]
        [--rounds 7] [--max-tokens 64] [--layouts single,tp2]

For each layout (`single`: one node, the torch-free GGUF path; `tp2`: a TP=2 group of local
processes) it builds the serving engine once and runs, round after round, three requests of
`max-tokens` tokens each on the same prompt (temperature 1, seed 1): plain (EOS ignored), under
the schema with the mask computed when asked (`ahead=False`), and under the schema with the mask
computed ahead (the default). The schema (`structured_decode.SCHEMA`) needs more than
`max-tokens` tokens, so every request runs to the limit under the mask at every step.

Per request: the decode rate, (tokens - 1) / (last token's time - first's); and, for the masked
ones, the head's time blocked in `allowed()` per token (computing the mask when asked; waiting
for the worker's when ahead): the mask's cost on the step's critical path. Prints each layout's
medians and the ratios to plain, and the whole result as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH leaves it out

from structured_decode import ASK, SCHEMA  # noqa: E402

from tandem.builtin import default_model  # noqa: E402
from tandem.cli.engine_factory import build_serving_engine  # noqa: E402
from tandem.engine.grammar import GrammarSpec  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402

KINDS = ("plain", "inline", "ahead")


class TimedMask:
    """A mask whose `allowed()` time on the caller's thread is summed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.blocked_s = 0.0
        self.calls = 0

    def allowed(self):
        t0 = time.perf_counter()
        out = self.inner.allowed()
        self.blocked_s += time.perf_counter() - t0
        self.calls += 1
        return out

    def advance(self, token: int) -> None:
        self.inner.advance(token)


def one(engine, prompt_ids: list[int], kind: str, max_tokens: int) -> dict:
    spec = GrammarSpec("json", schema=SCHEMA)
    mask = None if kind == "plain" else TimedMask(engine.grammar_mask(spec, kind == "ahead"))
    params = SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=1, ignore_eos=kind == "plain"
    )
    stamps: list[float] = []
    done = threading.Event()
    result: dict = {}

    def on_done(c, e) -> None:
        result.update(completion=c, error=e)
        done.set()

    engine.generate(prompt_ids, params, (), lambda d: stamps.append(time.perf_counter()),
                    on_done, mask)  # fmt: skip
    done.wait(600)
    if result.get("error") is not None:
        raise RuntimeError(result["error"])
    n = result["completion"].completion_tokens
    rate = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    out = {"tokens": n, "tok_s": round(rate, 2)}
    if mask is not None:
        out["blocked_us_per_token"] = round(mask.blocked_s / max(mask.calls, 1) * 1e6, 1)
    return out


def run(model: Path, layout: str, args: argparse.Namespace) -> dict:
    engine, stop = build_serving_engine(model, tp=2 if layout == "tp2" else 1, max_batch=2)
    try:
        prompt_ids = engine.encode(engine.chat_prompt(ASK))
        for kind in KINDS:  # warm: the grammar's vocabulary, the kernels' first calls
            one(engine, prompt_ids, kind, 8)
        rows: dict[str, list[dict]] = {k: [] for k in KINDS}
        for r in range(args.rounds):
            for kind in KINDS:
                rows[kind].append(one(engine, prompt_ids, kind, args.max_tokens))
            print(f"  {layout} round {r + 1}: " + ", ".join(
                f"{k} {rows[k][-1]}" for k in KINDS), file=sys.stderr, flush=True)  # fmt: skip
    finally:
        stop()
    med = {k: statistics.median(x["tok_s"] for x in rows[k]) for k in KINDS}
    blocked = {k: statistics.median(x["blocked_us_per_token"] for x in rows[k]) for k in KINDS[1:]}
    return {"rows": rows, "median_tok_s": med, "median_blocked_us_per_token": blocked,
            "ratio_inline": round(med["inline"] / med["plain"], 3),
            "ratio_ahead": round(med["ahead"] / med["plain"], 3)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2 Q4_1 if installed")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layouts", default="single,tp2")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_model()[0]
    result: dict = {"model": model.name, "max_tokens": args.max_tokens, "layouts": {}}
    for layout in args.layouts.split(","):
        r = run(model, layout, args)
        result["layouts"][layout] = r
        m, b = r["median_tok_s"], r["median_blocked_us_per_token"]
        print(
            f"{layout}: plain {m['plain']:.1f} tok/s; schema, mask when asked {m['inline']:.1f} "
            f"(x{r['ratio_inline']:.3f}, head blocked {b['inline']:.0f} us/token); schema, mask "
            f"ahead {m['ahead']:.1f} (x{r['ratio_ahead']:.3f}, head blocked {b['ahead']:.0f} "
            f"us/token)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
