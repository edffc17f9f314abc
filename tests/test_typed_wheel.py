"""Types reach users: the built wheel ships ``py.typed``, and mypy in a fresh environment that holds only that wheel
reads ``load_model``'s real signature (not ``Any``, not "missing library stubs")."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mypy() -> str:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed beside this Python (pip install -e '.[test]' installs it)")
    return mypy


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel as `pip wheel` builds it from a copy of the checkout (a build in the tree would leave build/ there, and
    a stale build/ would hide a file the package data misses), with this environment's setuptools: no download."""
    source = tmp_path_factory.mktemp("source") / "weightcache"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "out", "__pycache__", "benchmarks", "tests", "examples")
    shutil.copytree(ROOT, source, ignore=skip)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(out.glob("weightcache-*.whl"))


def test_the_wheel_ships_the_py_typed_marker_and_every_public_modules_stub(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "weightcache/py.typed" in names
    for stub in sorted(ROOT.joinpath("weightcache").glob("*.pyi")):  # each public module reads its names from its stub
        assert f"weightcache/{stub.name}" in names, stub.name


def test_mypy_reads_load_models_signature_from_the_installed_wheel(wheel, tmp_path):
    mypy = _mypy()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, str(wheel)]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    user = tmp_path / "user" / "app.py"
    user.parent.mkdir()
    user.write_text(
        "import weightcache\nimport weightcache.adapter\n\nreveal_type(weightcache.load_model)\nreveal_type(weightcache.adapter.hookimpl)\n"
    )
    # Outside the checkout, with no MYPYPATH and the fresh environment's site-packages only: what a user's mypy sees.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MYPY_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [mypy, "--python-executable", str(python), "--no-error-summary", "app.py"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=user.parent,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert "py.typed" not in out and "import-untyped" not in out and "import-not-found" not in out, out
    revealed = next((line for line in out.splitlines() if "Revealed type" in line), out)
    assert "def (model: str, *, adapter: str =" in revealed, revealed
    assert revealed.endswith('-> weightcache.core.flow.modes.LoadedModel"'), revealed
