"""`tandem quantize DIR OUT.gguf --type q4_k`, then `tandem generate --model OUT.gguf` in its own
process, end to end: the file generates (prompt text through the tokenizer it carries) the same
greedy ids as `tandem generate --model DIR --quantize q4_k`, which quantizes in memory (run in
this process, as are `quantize` and the refusal, to spare the suite two interpreter starts)."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tandem.cli.main import main
from tandem.loaders.tokenizer_build import build_byte_bpe, tokenizer_config
from tandem.loaders.writer import write_model_dir
from tandem.models.presets import get_preset, hot_rows, random_weights

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


GENERATE = ["--prompt", "the quick brown fox", "--max-tokens", "8", "--ignore-eos", "--json"]


def in_process(capsys, *args) -> tuple[int, str, str]:
    threads = torch.get_num_threads()
    try:
        rc = main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    config = replace(get_preset("tiny-qwen3").config, head_dim=128, **SHAPE)
    tok = build_byte_bpe(config.vocab_size)
    out = tmp_path_factory.mktemp("hf") / "m"
    tensors = random_weights(config, 7, torch.float32, hot_rows(config, None))
    write_model_dir(
        out, config, tensors, tokenizer_json=tok.to_str(), tokenizer_config=tokenizer_config()
    )
    return out


def test_quantize_then_generate_from_the_file_matches_quantize_at_load(hf_dir, tmp_path, capsys):
    out = tmp_path / "m-q4_k.gguf"
    rc, msg, _ = in_process(capsys, "quantize", hf_dir, out, "--type", "q4_k")
    assert rc == 0 and "wrote" in msg and out.is_file()
    cmd = [sys.executable, "-m", "tandem", "generate", "--model", str(out), *GENERATE]
    p = subprocess.run([*cmd, "--threads", "1"], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    from_file = json.loads(p.stdout.strip().splitlines()[-1])
    rc, stdout, _ = in_process(
        capsys, "generate", "--model", hf_dir, "--quantize", "q4_k", *GENERATE
    )
    at_load = json.loads(stdout.strip().splitlines()[-1])
    assert rc == 0 and len(from_file["token_ids"]) == 8
    assert from_file["token_ids"] == at_load["token_ids"] and from_file["text"] == at_load["text"]
    rc, _, err = in_process(capsys, "generate", "--model", out, "--quantize", "q4_k", *GENERATE)
    assert rc == 2 and "keeps its own types" in err
    rc, _, err = in_process(capsys, "quantize", hf_dir, tmp_path / "x.bin", "--type", "q8_0")
    assert rc == 2 and "must end in .gguf" in err
