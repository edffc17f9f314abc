"""benchmarks/server_restart.py on CUDA VMM arenas: the server holds their fds as it holds memfds (the CPU half:
tests/benchmarks/test_server_restart.py)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from weightcache.core.arena.cuda import unavailable_reason

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no CUDA GPU: {_REASON}")
ROOT = Path(__file__).resolve().parents[2]


def test_each_way_keeps_what_it_should_with_cuda_arenas(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("server_restart")
    out = tmp_path / "restart.json"
    argv = ["--device", "cuda:0", "--entries", "6", "--mib", "4", "--attached", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    kept = {row["way"]: (row["kept"], row["of"]) for row in result["rows"]}
    assert kept == {
        "planned restart": (6, 6),
        "upgrade": (6, 6),
        "SIGKILL, no fd store": (2, 6),
        "SIGKILL, with fd store": (6, 6),
    }
    assert result["device"] == "cuda:0" and result["gpu"]
