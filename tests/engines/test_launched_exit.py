"""A process launched from a launcher that preloaded a nanobind extension (Triton, which vLLM and SGLang import) ends
as the exec'd one does: its exit prints nothing of nanobind's leak report."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


def test_a_launched_process_that_imported_triton_exits_without_nanobinds_leak_report():
    pytest.importorskip("triton")
    from tests.core.test_launcher import LauncherProcess, both

    directory = Path(tempfile.mkdtemp(prefix="wc-launcher-"))
    started = LauncherProcess(directory / "sock", "--preload", "triton", "--no-warm")
    try:
        assert started.ready is not None, started.output()
        code = "import triton; print('done')"
        launched, execd = both(started, ["-c", code], capture_output=True, text=True, timeout=300)
    finally:
        started.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert launched.returncode == execd.returncode == 0, (launched, execd)
    assert launched.stdout == execd.stdout == "done\n"
    assert "nanobind" not in execd.stderr  # the test's premise: an exec'd interpreter frees Triton's objects
    assert "nanobind" not in launched.stderr, launched.stderr
