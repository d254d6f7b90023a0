"""The README's first command, `bash scripts/serve.sh`, where it cannot install."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"


def _externally_managed(python: str) -> bool:
    probe = ("import os, sys, sysconfig; sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists("
             "os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) else 1)")
    return os.path.exists(python) and subprocess.run([python, "-c", probe]).returncode == 0


@pytest.mark.skipif(not _externally_managed(SYSTEM_PYTHON), reason="no externally managed system Python here")
def test_serve_sh_on_a_system_python_that_refuses_pip_says_to_use_a_venv(tmp_path):
    """On Debian's or Ubuntu's own Python (PEP 668) pip refused the install with its own
    page of text, and nothing said that the script takes `PYTHON=` (a venv's python)."""
    env = {**os.environ, "PYTHON": SYSTEM_PYTHON, "HOME": str(tmp_path)}
    r = subprocess.run(["bash", "scripts/serve.sh", "--port", "1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "python3 -m venv .venv && PYTHON=.venv/bin/python bash scripts/serve.sh" in r.stderr, r.stderr
    assert "pip install" not in r.stdout  # refused before pip ran
