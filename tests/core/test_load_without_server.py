"""``weightcache load`` with no server running says so at once, on a busy machine too: the adapter's imports, started in
a thread beside the load, do not hold the one-line error back.

Through the real console script in a fresh process (its start is the subject), beside processes that keep every CPU
busy, on a checkpoint whose layout is not remembered (the hf adapter's warm-up then imports transformers). Python's
bytecode caches are written and used, as in an installed weightcache (an environment's ``PYTHONDONTWRITEBYTECODE``
would make every start compile weightcache again, which is not what is measured here): one untimed run writes them.

What tells waiting for the import thread apart is the CPU time the command used (CPU_LIMIT_S: a framework's import
costs seconds of CPU, on a busy machine or not). Its wall time is held to an order of magnitude only (no test asserts
a wall-clock bound a loaded machine can miss): 2 s, or ten times a bare ``weightcache status`` with no server timed
beside the same loops, which says how slow a start is on a machine that other work keeps busier still (the shared CI
VM, with a second ``make test`` beside this one).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightcache.adapter import usable_cpus

DEADLINE_S = 2.0
CPU_LIMIT_S = 1.0
"""What the command itself may spend: its own checks, not the framework imports of the adapter's warm-up thread."""


def _normal_priority() -> None:
    """A child at the default priority even where the tests run under ``nice`` (where this process may raise it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        pass


@pytest.fixture
def busy_cpus():
    """One busy loop per usable CPU, and one more, for the test's duration."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL, preexec_fn=_normal_priority)
        for _ in range(usable_cpus() + 1)
    ]
    try:
        time.sleep(0.5)  # every loop is running before the command starts
        yield len(loops)
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait(timeout=30)


def _without_server(command: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """``weightcache COMMAND --socket-dir EMPTY``'s result, its wall time and the CPU time it used."""
    empty = tmp_path / "no-server"
    empty.mkdir(mode=0o700, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["WEIGHTCACHE_CACHE_DIR"] = str(tmp_path / "fresh-cache")  # no remembered layout: the warm-up would import
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("weightcache")), *command, "--socket-dir", str(empty)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=_normal_priority,
    )
    took = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.fixture
def checkpoint(model_dir, tmp_path):
    """A Llama checkpoint, and weightcache's bytecode caches written by one untimed run."""
    path = model_dir("llama")
    _without_server(["load", "--model", str(path)], tmp_path)
    return path


@pytest.mark.serial  # a wall-clock bound: it runs alone, not beside the parallel workers
def test_load_without_a_server_fails_at_once_without_a_frameworks_import_under_cpu_load(checkpoint, tmp_path, busy_cpus):
    _, bare, _ = _without_server(["status"], tmp_path)
    proc, took, cpu = _without_server(["load", "--model", str(checkpoint)], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "weightcache: error:" in proc.stderr and "weightcache serve" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert cpu <= CPU_LIMIT_S, f"`weightcache load` used {cpu:.2f} CPU-s to say there is no server: did it import a framework?"
    assert took <= max(DEADLINE_S, 10 * bare), (
        f"`weightcache load` took {took:.2f} s ({cpu:.2f} CPU-s; a bare `weightcache status` {bare:.2f} s) to say there "
        f"is no server beside {busy_cpus} busy loops:\n{proc.stderr}"
    )
