"""`tandem generate --model FILE.gguf`: the CLI runs a GGUF file (weights in their blocks) with the
in-process reference's greedy ids, single-node, as a pipeline whose stages hold whole layers,
tensor-parallel (each rank holding its own blocks) and as a grid with a TP stage."""

import json
import os
import subprocess
import sys

import pytest

from tandem.engine.generate import generate
from tandem.engine.local import LocalExecutor
from tandem.engine.sampling_params import SamplingParams
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model

PROMPT = [5, 6, 7, 8, 9]
NEW = 12


def cli(model, *extra, ok=True, env=None):
    cmd = [sys.executable, "-m", "tandem", "generate", "--model", str(model), "--prompt-ids"]
    cmd += [",".join(map(str, PROMPT)), "--max-tokens", str(NEW), "--ignore-eos", "--json"]
    cmd += ["--threads", "1", *extra]
    env = None if env is None else dict(os.environ, **env)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    if not ok:
        return out
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    _, (f,) = write_preset_gguf(d / "tiny.gguf", "tiny-qwen3-untied", "Q4_1", seed=5)
    return f


def test_generate_on_a_gguf_file_prints_the_reference_ids_single_node_and_at_pp2(gguf):
    model = load_model(open_model(gguf))
    ex = LocalExecutor(model, max_batch=1, max_seq_len=len(PROMPT) + NEW)
    (want,) = generate(ex, [PROMPT], SamplingParams(max_tokens=NEW, temperature=0.0))
    single = cli(gguf)
    assert single["token_ids"] == want.token_ids and single["dtype"] == "float32"
    assert cli(gguf.parent)["token_ids"] == want.token_ids  # the folder holding it
    pp2 = cli(gguf, "--pp", "2")
    assert pp2["token_ids"] == want.token_ids
    ranges = [tuple(s["layers"]) for s in pp2["pipeline"]["stages"]]
    assert (
        len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] < ranges[1][1] == 3
    )


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2", "--layout", "2,1")])
def test_tensor_parallel_generate_over_a_gguf_file_prints_the_reference_ids(gguf, layout):
    model = load_model(open_model(gguf))
    ex = LocalExecutor(model, max_batch=1, max_seq_len=len(PROMPT) + NEW)
    (want,) = generate(ex, [PROMPT], SamplingParams(max_tokens=NEW, temperature=0.0))
    assert cli(gguf, *layout, "--dtype", "float32")["token_ids"] == want.token_ids


def test_one_cpu_node_on_a_quantized_gguf_runs_without_torch(gguf):
    """The default single-node run on the CPU takes the torch-free LeanExecutor (torch never
    imported in the process), with the torch path's ids; a bfloat16 run, or TANDEM_LEAN=0, takes
    LocalExecutor."""
    code = (
        "import sys; from tandem.cli.main import main; rc = main(sys.argv[1:]); "
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)"
    )
    cmd = [sys.executable, "-c", code, "generate", "--model", str(gguf), "--prompt-ids"]
    cmd += [",".join(map(str, PROMPT)), "--max-tokens", str(NEW), "--ignore-eos", "--json"]
    out = subprocess.run(cmd + ["--device", "cpu"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TORCH False" in out.stderr
    lean = json.loads(out.stdout.strip().splitlines()[-1])
    assert lean["executor"] == "LeanExecutor" and lean["dtype"] == "float32"
    # the ISA build each of the file's weight types took, decode and prefill (variant_choice)
    assert lean["kernels"]["cpu"] and lean["kernels"]["kernels"]
    for classes in lean["kernels"]["kernels"].values():
        assert {c["variant"] for c in classes.values()} <= {"avx2", "avx2-vnni", "avx512"}
    torch_path = cli(gguf, "--device", "cpu", "--dtype", "float32", env={"TANDEM_LEAN": "0"})
    assert torch_path["executor"] == "LocalExecutor"
    assert lean["token_ids"] == torch_path["token_ids"]
    assert cli(gguf, "--device", "cpu", "--dtype", "bfloat16")["executor"] == "LocalExecutor"
