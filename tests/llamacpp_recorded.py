"""llama.cpp's greedy ids recorded beside the converter-made Qwen3.5 fixtures
(`scripts/bench/qwen35_llamacpp.py --record`: `<file>.llamacpp.json`), and tandem's greedy decode
of the same prompts together, for the tests that hold any executor to them (CI has no llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.engine.executor import Step, StepSequence

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"
CONVERTER_FILES = ["tiny-qwen35-converter-f32.gguf", "tiny-qwen35moe-converter-f32.gguf"]


def recorded(name: str) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(the fixture, its prompts, llama.cpp's greedy ids after each)."""
    f = FIXTURES / name
    runs = json.loads(f.with_suffix(".llamacpp.json").read_text())["runs"]
    return f, [r["prompt"] for r in runs], [r["llama_cpp"] for r in runs]


def greedy_together(ex, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy ids after each prompt, every prompt in each step (`ex` any Executor)."""
    out: list[list[int]] = [[] for _ in prompts]
    seqs = [StepSequence(i, tuple(p), 0) for i, p in enumerate(prompts)]
    for _ in range(n):
        ids = ex.run(Step(tuple(seqs), greedy=True)).token_ids
        ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        for i, t in enumerate(ids):
            out[i].append(t)
        seqs = [StepSequence(i, (t,), len(prompts[i]) + len(out[i]) - 1) for i, t in enumerate(ids)]
    return out
