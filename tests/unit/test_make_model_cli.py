import subprocess
import sys

from tandem.loaders.safetensors_dir import ModelDir


def test_make_model_cli_writes_a_loadable_hf_directory(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem",
            "make-model",
            str(tmp_path / "m"),
            "--preset",
            "tiny-mistral",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    md = ModelDir(tmp_path / "m")
    assert md.config.architecture == "MistralForCausalLM"
    assert (tmp_path / "m" / "tokenizer.json").exists()
