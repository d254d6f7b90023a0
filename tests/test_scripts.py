"""The README's two commands' install steps: `bash scripts/serve.sh` where it cannot install,
and which torch they install."""

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


@pytest.mark.parametrize("driver, want, expect", [
    (False, "", "--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu"),
    (True, "", "install torch==2.13.0"),
    (True, "cpu", "--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu"),
])
def test_the_scripts_install_the_cpu_torch_where_no_nvidia_driver_answers(tmp_path, driver, want, expect):
    """PyPI's torch==2.13.0 for Linux is the CUDA build: a fresh CPU machine downloaded it
    (multi-GB), and vLLM's CPU build, pinned to torch==2.13.0+cpu, could not install at all.
    (A stand-in python without torch records what pip was asked; a stand-in nvidia-smi.)"""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "pip.log"
    python = bin_ / "python"
    python.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 1\necho "$@" >> {log}\n')
    smi = bin_ / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n" if driver else "#!/bin/sh\nexit 9\n")
    for f in (python, smi):
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:/usr/bin:/bin"}
    r = subprocess.run(["bash", "scripts/install-torch.sh", str(python), *([want] if want else [])], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert log.read_text().strip().endswith(expect), log.read_text()
