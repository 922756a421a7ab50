"""llama.cpp's greedy ids recorded beside the converter-made Qwen3.5 fixtures
(`scripts/bench/qwen35_llamacpp.py --record`: `<file>.llamacpp.json`), for the tests that hold
any executor to them (CI has no llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"
CONVERTER_FILES = ["tiny-qwen35-converter-f32.gguf", "tiny-qwen35moe-converter-f32.gguf"]


def recorded(name: str) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(the fixture, its prompts, llama.cpp's greedy ids after each)."""
    f = FIXTURES / name
    runs = json.loads(f.with_suffix(".llamacpp.json").read_text())["runs"]
    return f, [r["prompt"] for r in runs], [r["llama_cpp"] for r in runs]
