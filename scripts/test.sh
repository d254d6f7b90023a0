#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine, then run every test.
# This is the README's test command, and .ci/run calls it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first, pinned: with no torch present, a bare `torch` requirement pulls a
# multi-GB CUDA build. An existing torch (CPU or CUDA) is kept as it is.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi

"$PY" -m pip install -e ".[server,redis,demo,test]"

# The redis tier's tests start their own redis-server processes (on free loopback ports,
# never 6379): install Debian's redis-server and redis-tools (redis-cli) when missing.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools
fi

# The dashboard's tests drive a real headless Chromium: install Debian's when missing.
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi

exec "$PY" -m pytest "$@"
