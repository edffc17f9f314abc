"""benchmarks/server_restart.py: every way of restarting keeps what it should, on the device it is given."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("server_restart")


def test_each_way_keeps_what_it_should_on_the_cpu(bench, tmp_path):
    out = tmp_path / "restart.json"
    assert bench.main(["--entries", "6", "--mib", "0.25", "--attached", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    kept = {row["way"]: (row["kept"], row["of"], row["disk_bytes"]) for row in result["rows"]}
    assert kept == {
        "planned restart": (6, 6, 0),
        "upgrade": (6, 6, 0),
        "SIGKILL, no fd store": (2, 6, 4 * (1 << 18)),
        "SIGKILL, with fd store": (6, 6, 0),
    }
    assert result["device"] == "cpu" and result["gpu"] is None
    assert all(row["attachable_s"] < 10 for row in result["rows"])


def test_a_cuda_device_without_a_gpu_is_refused_before_anything_starts():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/gpu/test_server_restart_gpu.py runs the CUDA rows")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "server_restart.py"), "--device", "cuda:0", "--entries", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--device: cuda:0: no CUDA GPU here" in done.stderr and "run the CUDA rows on a GPU machine" in done.stderr


def test_a_device_that_does_not_parse_names_the_accepted_spellings():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "server_restart.py"), "--device", "gpu0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--device" in done.stderr and "cuda" in done.stderr, done.stderr
