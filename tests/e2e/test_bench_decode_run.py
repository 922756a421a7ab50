"""The bench's per-layout process (`tandem.bench.decode_run`): a TP=2 head and worker on loopback
decode the same greedy ids as the single node and say whether they swapped through shared memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.cluster.launcher import free_ports
from tandem.loaders.make import make_model_dir


def _argv(model, layout: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tandem.bench.decode_run", "--model", str(model),
            "--layout", layout, "--threads", "1", "--prompt-len", "8", "--decode", "6",
            "--warmup", "1", "--rounds", "1", "--max-seq-len", "32", *extra]  # fmt: skip


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("shm", ["1", "0"])
def test_tp2_decode_run_matches_single_and_reports_same_host_memory(tmp_path, shm: str) -> None:
    model = tmp_path / "m"
    make_model_dir(model, preset="tiny-qwen3", seed=3)
    single = subprocess.run(_argv(model, "single"), capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr[-2000:]
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    tp = [*_argv(model, "tp"), "--world", "2", "--peers", peers, "--secret", "s3cr3t"]
    env = {**os.environ, "TANDEM_SHM": shm}
    procs = [subprocess.Popen([*tp, "--rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (1, 0)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    head = _last_json(outs[1][0])
    assert head["token_ids"] == _last_json(single.stdout)["token_ids"]
    assert head["same_host_memory"] is (shm == "1")


def test_bench_runs_a_gguf_file_single_and_tp2_on_loopback_and_writes_its_report(tmp_path) -> None:
    """`tandem bench --model FILE.gguf`: the tiny Q4_0 file's single node and TP=2 (shards cut on
    block boundaries, the quantized kernels) decode the same ids, and bench.json / bench.md say which
    file and format ran, with no HF peer."""
    from tandem.kernels.quant_linear import QUANT
    from tandem.loaders.gguf.writer import write_preset_gguf

    _, (gguf,) = write_preset_gguf(tmp_path / "tiny.gguf", "tiny-qwen3", "Q4_0", seed=5)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "tandem.cli.main", "bench", "--model", str(gguf),
            "--layouts", "single,tp2", "--links", "loopback", "--prompt-len", "8",
            "--decode", "4", "--rounds", "1", "--no-collectives", "--no-probes",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "bench.json").read_text())
    assert doc["model"]["gguf"] and doc["model"]["weight_format"].startswith("GGUF")
    assert doc["model"]["file_bytes"] == gguf.stat().st_size
    runs = {r["layout"]: r for r in doc["runs"]}
    assert set(runs) == {"single", "TP=2"} and not any("error" in r for r in runs.values())
    assert runs["TP=2"]["token_ids"] == runs["single"]["token_ids"]
    assert set(runs["single"]["kernel_layers"]) == {QUANT}  # every linear on its blocks' kernel
    assert "hf" not in doc["peers"] and "HF transformers peer skipped" in proc.stderr
    md = (out / "bench.md").read_text()
    assert "tiny.gguf" in md and "| TP=2 |" in md
