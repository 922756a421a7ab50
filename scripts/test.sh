#!/usr/bin/env bash
# The test command: set-up, lint, format check, import-layer contracts, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh || echo "test.sh: no chromium: the web page's browser test will skip" >&2
.venv/bin/ruff check tandem tests scripts
.venv/bin/ruff format --check tandem tests scripts
.venv/bin/lint-imports
.venv/bin/python -m pytest -q --durations=15 "$@"
