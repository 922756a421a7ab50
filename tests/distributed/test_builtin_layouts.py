"""The built-in model writes the same greedy text single-node, at TP=2 and at PP=2: each layout is a
real `tandem generate` run (the head plus worker / stage processes over loopback TCP)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from builtin_golden import GOLDEN_IDS, GOLDEN_TOKENS

from tandem.builtin import BUILTIN_PROMPT, default_model_dir


def generate_json(*layout: str) -> dict:
    """`tandem generate` on the built-in model and prompt (named: the default is SmolLM2 when
    installed), greedy."""
    cmd = [sys.executable, "-m", "tandem", "generate", "--json", "--threads", "1"]
    cmd += ["--model", str(default_model_dir()), "--prompt", BUILTIN_PROMPT]
    cmd += ["--dtype", "float32"]  # a layout change keeps greedy output only in f32
    cmd += ["--max-tokens", str(GOLDEN_TOKENS), "--ignore-eos", *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single_node() -> dict:
    return generate_json()


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_builtin_greedy_output_is_identical_across_layouts(single_node, layout):
    assert single_node["token_ids"] == GOLDEN_IDS
    out = generate_json(*layout)
    assert out["token_ids"] == single_node["token_ids"]
    assert out["text"] == single_node["text"]
    assert ("tensor_parallel" in out) == (layout[0] == "--tp")
    assert ("pipeline" in out) == (layout[0] == "--pp")
