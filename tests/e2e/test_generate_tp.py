"""`tandem generate --tp 2` as a user runs it: same ids as single-node, plus the communication figures."""

import json
import os
import subprocess
import sys

from tandem.loaders.make import make_model_dir


def _generate(model_dir, *extra, threads="1", env=None):
    cmd = [sys.executable, "-m", "tandem", "generate", "--model", str(model_dir)]
    cmd += ["--prompt-ids", "5,6,7,8,9", "--max-tokens", "12", "--ignore-eos", "--json"]
    cmd += (["--threads", threads] if threads else []) + list(extra)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_generate_tp2_prints_single_node_ids_and_comm_figures(tmp_path):
    d = tmp_path / "m"
    make_model_dir(d, "tiny-qwen3", seed=0)
    single = _generate(d, "--dtype", "float32")
    tp = _generate(d, "--tp", "2", "--tp-weights", "2,1", "--dtype", "float32,float32")
    assert tp["token_ids"] == single["token_ids"]
    report = tp["tensor_parallel"]
    assert report["tp"] == 2 and report["tp_weights"] == [2.0, 1.0]
    assert [r["dtype"] for r in report["ranks"]] == ["float32", "float32"]
    assert [r["threads"] for r in report["ranks"]] == [1, 1]  # --threads 1 reaches every rank
    per_token = report["comm_per_token"]
    # 2 layers x 2 all-reduces + embedding all-reduce + logits to the head + the step broadcast
    assert per_token["collectives"] >= 7
    assert per_token["bytes_on_wire"] > 0 and per_token["ms_in_collectives"] > 0
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert key in tp


def test_generate_with_attention_on_one_of_two_ranks_prints_the_single_node_ids(tmp_path):
    d = tmp_path / "m"
    make_model_dir(d, "tiny-qwen3", seed=0)
    single = _generate(d, "--dtype", "float32")
    split = _generate(d, "--tp", "2", "--attn-ranks", "1", "--dtype", "float32")
    assert split["token_ids"] == single["token_ids"]
    assert split["tensor_parallel"]["attn_ranks"] == 1


def test_generate_tp_splits_the_machines_threads_among_its_ranks(tmp_path):
    # full OpenMP pools per co-located rank oversubscribe the cores (cli/threads.py): without
    # --threads the ranks share OMP_NUM_THREADS (else the cores), as each rank reports (with
    # --threads, the test above)
    d = tmp_path / "m"
    make_model_dir(d, "tiny-qwen3", seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    split = _generate(d, "--tp", "2", threads=None, env=env)["tensor_parallel"]["ranks"]
    assert [r["threads"] for r in split] == [2, 2]


def test_generate_rejects_a_per_rank_list_of_the_wrong_length(tmp_path):
    d = tmp_path / "m"
    make_model_dir(d, "tiny-qwen3", seed=0)
    cmd = [sys.executable, "-m", "tandem", "generate", "--model", str(d), "--prompt-ids", "5,6"]
    cmd += ["--tp", "2", "--dtype", "float32,float16,bfloat16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "one per rank" in out.stderr


def test_generate_tp2_runs_the_qwen35_hybrid_and_refuses_more_ranks_than_its_heads(tmp_path):
    """tiny-qwen35 (2 DeltaNet q/k heads): TP=2 gives the single node's ids; TP=3 would leave a
    rank without a q/k head and is refused in one line naming them, exit status 2."""
    d = tmp_path / "m"
    make_model_dir(d, "tiny-qwen35", seed=0)
    single = _generate(d, "--dtype", "float32")
    assert _generate(d, "--tp", "2", "--dtype", "float32")["token_ids"] == single["token_ids"]
    cmd = [sys.executable, "-m", "tandem", "generate", "--model", str(d), "--prompt-ids", "5,6",
           "--max-tokens", "2", "--tp", "3", "--threads", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "linear_num_key_heads" in out.stderr.strip().splitlines()[-1]
