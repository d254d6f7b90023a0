"""The package ships its annotations (py.typed): users' type checkers read them, so they
must hold. mypy checks cacheseek and server with the settings of pyproject's [tool.mypy]."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~45 s with a cold cache on 2 cores (~2 s warm: .mypy_cache in the checkout)
def test_mypy_passes_on_the_package():
    out = subprocess.run([sys.executable, "-m", "mypy", "cacheseek", "server"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"mypy found errors:\n{out.stdout}{out.stderr}"
    assert "Success: no issues found" in out.stdout, out.stdout


def test_the_package_is_marked_typed():
    assert (ROOT / "cacheseek" / "py.typed").is_file()
    assert (ROOT / "server" / "py.typed").is_file()  # (installed as cacheseek/server)
