#!/usr/bin/env bash
# Install torch 2.13.0 into the Python given ($1, default python3) when it has none; an
# existing torch (CPU or CUDA) is kept as it is. Where an NVIDIA driver answers (nvidia-smi)
# and $2 is not "cpu", PyPI's build, which is the CUDA one; on Linux otherwise, the CPU
# build from PyTorch's CPU index: PyPI's torch==2.13.0 for Linux is the CUDA build
# (multi-GB, with CUDA wheels never used there), and vLLM's CPU build pins
# torch==2.13.0+cpu, which only that index holds.
# Used by serve.sh and test.sh.
set -euo pipefail
PY=${1:-python3}
WANT=${2:-}
if "$PY" -c "import torch" 2>/dev/null; then
  exit 0
fi
if [ "$(uname -s)" != Linux ] || { [ "$WANT" != cpu ] && nvidia-smi >/dev/null 2>&1; }; then
  "$PY" -m pip install "torch==2.13.0"
else
  # (--retries 1: a machine that cannot reach that index, its wheel in a mirror or a
  # find-links folder pip is configured with, goes on at once, a warning a package)
  "$PY" -m pip install --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
fi
