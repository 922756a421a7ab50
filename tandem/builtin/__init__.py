"""The built-in model: a small Qwen3-layout model trained by tandem itself, shipped in the package.

`default_model_dir()` is what `tandem generate`, `tandem serve` and `tandem launch` load when no
`--model` is given, so a first run prints readable text instead of random-weight noise. The model
(about 5 M parameters, float32, in the Hugging Face layout) was trained by
`scripts/train_builtin.py` on the Python Language Reference text in CPython's `pydoc_data`
(PSF License, see LICENSE-corpus.txt next to the weights); training_report.json records the corpus
hash, the recipe and the held-out loss next to a unigram baseline's.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_NAME = "pydoc-qwen3-5m"
# What `tandem generate` continues when given no prompt: a section heading of the corpus's kind.
BUILTIN_PROMPT = 'The "import" statement\n\nThe'
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


class BuiltinModelMissingError(FileNotFoundError):
    """The built-in model's files are not in this installation (a broken or partial install)."""


def default_model_dir() -> Path:
    """The directory of the built-in model, checked to hold every file a loader needs."""
    path = Path(__file__).resolve().parent / BUILTIN_MODEL_NAME
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise BuiltinModelMissingError(
            f"the built-in model at {path} lacks {', '.join(missing)}; reinstall tandem, or "
            "rebuild it with `python scripts/train_builtin.py`, or pass --model DIR"
        )
    return path
