#!/usr/bin/env bash
# Install CacheSeek with its server extra on a fresh machine and run the service on its
# embedded default: a 4 GiB CPU tier plus a 64 GiB disk tier under ~/.cache/cacheseek/store,
# on 127.0.0.1:8080. This is the README's first command. Extra arguments go to
# `cacheseek serve` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Debian's and Ubuntu's own Python refuses pip installs (PEP 668) with a page of its own
# that does not say this script takes a venv's python: say so, before anything runs.
if "$PY" -c "import os, sys, sysconfig; sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) else 1)" 2>/dev/null; then
  echo "scripts/serve.sh: $PY is the system's Python, which refuses pip installs (PEP 668); use a venv:" >&2
  echo "  python3 -m venv .venv && PYTHON=.venv/bin/python bash scripts/serve.sh" >&2
  exit 2
fi

# torch first, pinned (install-torch.sh: the CPU build where no NVIDIA driver answers): with
# no torch present, a bare `torch` requirement pulls a multi-GB CUDA build.
bash scripts/install-torch.sh "$PY"
"$PY" -m pip install -e ".[server,redis]"
exec "$PY" -m cacheseek.server.cli serve "$@"
