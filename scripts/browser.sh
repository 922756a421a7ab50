#!/usr/bin/env bash
# Installs Debian's chromium and chromium-driver (the web page's browser test drives them through
# selenium) when they are missing. Idempotent: does nothing when both are there. Needs root and
# apt-get; otherwise it says why on stderr and exits 1 (the browser test then skips with that reason).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "browser.sh: chromium or chromium-driver is missing, and installing them needs root" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "browser.sh: chromium or chromium-driver is missing, and there is no apt-get" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
