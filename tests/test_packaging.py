"""The distribution ships cacheseek.kernels and cacheseek.server, from a wheel and editable."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import cacheseek, cacheseek.kernels, cacheseek.server, cacheseek.quant, cacheseek.store;"
    "print(cacheseek.__file__); print(cacheseek.kernels.__file__); print(cacheseek.server.__file__)"
)


def test_editable_install_maps_kernels_and_server(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    pkg, kernels, server = (Path(p) for p in out.stdout.split())
    assert kernels.parent == ROOT / "cacheseek" / "kernels"
    assert server.parent == ROOT / "server"
    assert pkg.parent == ROOT / "cacheseek"


def test_the_repository_root_holds_no_kernels_package():
    """pytest and `python -m benchmarks...` put the repository's root on sys.path: a folder
    there named `kernels` would be imported for Hugging Face's `kernels` package, which
    transformers 5.25 imports (and then fails to import). The kernels are cacheseek/kernels/."""
    probe = "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); print(getattr(importlib.util.find_spec('kernels'), 'origin', None))"
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT)], capture_output=True, text=True, check=True, cwd=ROOT)
    origin = out.stdout.strip()
    assert origin == "None" or Path(origin).parent.parent != ROOT, origin


@pytest.mark.slow
def test_wheel_ships_kernels_and_server_under_cacheseek(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("cacheseek-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cacheseek/kernels/__init__.py" in names
    assert "cacheseek/server/__init__.py" in names
    for asset in ("index.html", "dashboard.js", "dashboard.css"):  # the dashboard is served from the package
        assert f"cacheseek/server/dashboard/{asset}" in names
    # PEP 561: without the marker, a user's type checker ignores the package's annotations
    assert "cacheseek/py.typed" in names and "cacheseek/server/py.typed" in names
    # every subpackage of the source tree ships (pyproject lists them by hand): server/routes
    # did not, and an installed server (the wheel, the Docker image) failed at start
    for init in (ROOT / "cacheseek").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names, init
    for init in (ROOT / "server").rglob("__init__.py"):
        assert "cacheseek/" + init.relative_to(ROOT).as_posix() in names, init
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"kernels", "server", "tests", "benchmarks"}, tops
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", PROBE + "; import cacheseek.server.app"], cwd=tmp_path,
                         capture_output=True, text=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.split():
        assert Path(line).is_relative_to(target), line
