#!/usr/bin/env bash
# Fetches llama.cpp's copies of the models' own chat templates (models/templates/*.jinja) for the
# tool-call format tests: from the llama-cpp-python sdist on PyPI (the llama.cpp it vendors, the
# version ../shared/tools/llamacpp.sh builds), its sha256 checked, only that folder extracted into
#   ${TANDEM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tandem}/llamacpp-templates/models/templates
# (where tests/llamacpp_templates.py looks). Idempotent: does nothing when the folder holds this
# version's templates. Without PyPI it says why on stderr and exits 1 (the template tests then skip).
set -euo pipefail
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
if [ -n "${TANDEM_CACHE:-}" ]; then ROOT=$TANDEM_CACHE; else ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/tandem; fi
DEST=$ROOT/llamacpp-templates
STAMP="llama-cpp-python==$VERSION sha256:$SHA256"
if [ -f "$DEST/SOURCE" ] && [ "$(cat "$DEST/SOURCE")" = "$STAMP" ]; then
  exit 0
fi
PY=${PYTHON:-python3}
[ -x "$(dirname "$0")/../.venv/bin/python" ] && PY="$(dirname "$0")/../.venv/bin/python"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if ! "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP" \
    >"$TMP/pip.log" 2>&1; then
  echo "templates.sh: could not download llama-cpp-python==$VERSION from PyPI:" >&2
  tail -n 3 "$TMP/pip.log" >&2
  exit 1
fi
SDIST=$TMP/llama_cpp_python-$VERSION.tar.gz
if ! echo "$SHA256  $SDIST" | sha256sum -c --status; then
  echo "templates.sh: llama_cpp_python-$VERSION.tar.gz does not have sha256 $SHA256" >&2
  exit 1
fi
tar xzf "$SDIST" -C "$TMP" --strip-components=4 "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates"
rm -rf "$DEST"
mkdir -p "$DEST/models"
mv "$TMP/templates" "$DEST/models/templates"
echo "$STAMP" >"$DEST/SOURCE"
