#!/usr/bin/env bash
# The test command: set-up, lint, format check, import-layer contracts, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh || echo "test.sh: no chromium: the web page's browser test will skip" >&2
.venv/bin/ruff check tandem tests scripts
.venv/bin/ruff format --check tandem tests scripts
.venv/bin/lint-imports
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=15 "$@"
fi
# Both stages on both cores (pytest-xdist): the in-process tests (unit, and the equivalence runs
# against transformers, one torch thread each), then the tests that start processes, a file at a
# time on each core (`--dist loadfile`: a file's module fixtures, a started server or a made
# model, are built once). A process test uses about one core on average (its processes spend
# their start importing torch, then wait on sockets and heartbeats), so two files at once halve
# the stage (1335-1435 s one at a time, 900 s two at a time, 2 cores). Both always run; the
# script fails if either did.
rc=0
.venv/bin/python -m pytest -q --durations=10 -n 2 tests/unit tests/equivalence || rc=$?
.venv/bin/python -m pytest -q --durations=15 -n 2 --dist loadfile tests/distributed tests/e2e || rc=$?
exit "$rc"
