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

exec "$PY" -m pytest "$@"
