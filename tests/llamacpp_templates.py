"""Where llama.cpp's copies of the models' own chat templates (models/templates/*.jinja) are:
under `$TANDEM_LLAMACPP_SRC` when it names a llama.cpp source tree, else in the folder
`scripts/templates.sh` fills from the pinned llama-cpp-python sdist (`scripts/setup.sh` runs it).
A test that needs one skips only when neither is there (set-up had no PyPI and said so)."""

import os
from pathlib import Path

import pytest


def folder() -> Path:
    src = os.environ.get("TANDEM_LLAMACPP_SRC")
    if src:
        return Path(src) / "models" / "templates"
    cache = os.environ.get("TANDEM_CACHE")
    root = (
        Path(cache)
        if cache
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"
    )
    return root / "llamacpp-templates" / "models" / "templates"


def path(name: str) -> Path:
    """The template file `name`.jinja, or a skip saying where it was looked for."""
    found = folder() / f"{name}.jinja"
    if not found.exists():
        pytest.skip(f"no {found.name} in {found.parent} (scripts/templates.sh fetches them)")
    return found


def template(name: str) -> str:
    return path(name).read_text()
