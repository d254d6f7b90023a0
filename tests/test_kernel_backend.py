"""No silent slow path: KV on a GPU without the Triton kernels is said (once, with the reason
and the fix), shown in stats(), and refused when the kernels were asked for."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import cacheseek as cs
from cacheseek.quant import backend
from store_helpers import make_cache

MISSING = "ModuleNotFoundError: No module named 'triton'"
ON_GPU = SimpleNamespace(is_cuda=True)  # what the dispatcher reads of a CUDA tensor
ON_CPU = SimpleNamespace(is_cuda=False)
HERE = Path(__file__).resolve().parent


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(backend, "kernels_import_error", lambda: MISSING)
    monkeypatch.setattr(backend, "_warned", threading.Event())


def test_cuda_kv_without_the_kernels_warns_once_with_the_reason_and_the_fix(no_kernels, monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    with pytest.warns(backend.KernelFallbackWarning) as said:
        assert backend.backend_for(ON_GPU) == "torch"
    message = str(said[0].message)
    assert "torch reference" in message and MISSING in message and "pip install" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.backend_for(ON_GPU) == "torch"  # once per process
        assert backend.backend_for(ON_CPU) == "torch"  # the reference is the plan on a CPU: no warning


def test_kernels_asked_for_and_missing_fail_hard_naming_the_reason(no_kernels, monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(cs.ConfigError, match="CACHESEEK_KIVI_BACKEND=triton.*No module named 'triton'"):
        backend.backend_for(ON_CPU)
    with pytest.raises(cs.ConfigError, match="cannot load"):
        make_cache(codec=cs.KIVI(bits=4))  # at construction, not at the first ingest


def test_stats_say_which_kernels_run(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    cache = make_cache()
    if backend.kernels_available():
        assert cache.stats()["kernels"] == "triton" and "kernels_reason" not in cache.stats()
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    stats = cache.stats()
    assert (stats["kernels"], stats["kernels_reason"]) == ("torch-reference", "CACHESEEK_KIVI_BACKEND=torch")
    monkeypatch.delenv(backend.BACKEND_ENV)
    monkeypatch.setattr(backend, "kernels_import_error", lambda: MISSING)
    stats = cache.stats()
    assert stats["kernels"] == "torch-reference" and MISSING in stats["kernels_reason"]


def test_a_process_that_cannot_import_triton_says_so():
    script = f"sys_path = {str(HERE)!r}\n" + """
import json, os, sys
sys.path.insert(0, sys_path)
sys.modules["triton"] = None  # `import triton` now fails, as where it is not installed
from store_helpers import make_cache
import cacheseek as cs
stats = make_cache(codec=cs.KIVI(bits=4)).stats()
os.environ["CACHESEEK_KIVI_BACKEND"] = "triton"
try:
    make_cache(codec=cs.KIVI(bits=4))
    refused = None
except cs.ConfigError as exc:
    refused = str(exc)
print(json.dumps({"kernels": stats["kernels"], "reason": stats.get("kernels_reason"), "refused": refused}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kernels"] == "torch-reference" and "triton" in got["reason"] and "pip install" in got["reason"]
    assert got["refused"] is not None and "triton" in got["refused"]
