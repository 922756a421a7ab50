"""`tandem generate --pp/--layout` runs the stage processes and prints the same ids as single-node,
plus the pipeline's communication figures (and, under `--pp-weights auto`, the stages' probes)."""

import json
import subprocess
import sys

import pytest


def generate(model, *extra):
    cmd = [
        sys.executable,
        "-m",
        "tandem",
        "generate",
        "--model",
        str(model),
        "--prompt-ids",
        "5,6,7,8,9",
    ]
    cmd += [
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "--dtype",
        "float32",
        "--threads",
        "1",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "m"
    cmd = [sys.executable, "-m", "tandem", "make-model", str(path), "--preset", "tiny-qwen3-untied"]
    subprocess.run(cmd + ["--seed", "5"], check=True, capture_output=True, timeout=120)
    return path


def test_generate_pp2_and_a_tp2_tp1_grid_print_the_single_node_ids(model):
    single = generate(model)
    pp2 = generate(model, "--pp", "2")
    grid = generate(model, "--layout", "2,1", "--pp-weights", "2,1")
    assert pp2["token_ids"] == single["token_ids"] == grid["token_ids"]
    assert [s["tp"] for s in grid["pipeline"]["stages"]] == [2, 1]
    assert [s["layers"] for s in grid["pipeline"]["stages"]] == [[0, 2], [2, 3]]
    # PP=2: per step, one hidden state out to stage 1 and one (last-token) hidden state back
    report = pp2["pipeline"]
    assert report["stage_sends"] == 12 and report["wire_dtype"] == "float32"
    assert report["wire_bytes"] > 0
    # one compute dtype per stage (the numbers: tests/distributed/test_tp_mixed_dtype.py)
    # ... here with the ranges from each stage's probe (`--pp-weights auto`), reported with them
    mixed = generate(model, "--pp", "2", "--dtype", "bfloat16,float16", "--pp-weights", "auto")
    assert [s["dtype"] for s in mixed["pipeline"]["stages"]] == ["bfloat16", "float16"]
    probes = mixed["pipeline"]["stage_probes"]
    assert len(probes) == 2 and all(p["gemv_gb_s"][0] > 0 and p["free_gb"][0] > 0 for p in probes)
    ranges = [s["layers"] for s in mixed["pipeline"]["stages"]]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 3


def test_generate_rejects_a_layout_that_disagrees_with_pp(model):
    cmd = [sys.executable, "-m", "tandem", "generate", "--model", str(model), "--prompt-ids", "1"]
    out = subprocess.run(
        cmd + ["--pp", "3", "--layout", "2,1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "--layout '2,1' has 2 stages but --pp is 3" in out.stderr
