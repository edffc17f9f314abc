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


_SLOW_EXIT = """
import multiprocessing, os, signal, sys, time
import psutil


def worker(ready):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # as vLLM's workers
    ready.send("started")
    while True:
        time.sleep(1)


def engine_core(ready, shut):
    def on_term(signum, frame):  # as vLLM's engine core: SystemExit, then its shutdown
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    context = multiprocessing.get_context("spawn")
    started, starting = context.Pipe(duplex=False)  # no semaphore: this process is killed at the end
    child = context.Process(target=worker, args=(starting,))
    child.start()
    assert started.recv() == "started"
    try:
        ready.set()  # in the try: SIGTERM may come at once
        while True:
            time.sleep(1)
    finally:
        child.terminate()
        child.join()
        shut.set()
        time.sleep(600)  # slower to exit than its parent waits, as vLLM's engine core on busy cores


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    ready, shut = context.Event(), context.Event()
    core = context.Process(target=engine_core, args=(ready, shut))
    core.start()
    assert ready.wait(240)
    core.terminate()
    assert shut.wait(240)
    left = psutil.Process(core.pid).children(recursive=True)
    for child in left:  # what vLLM's kill_process_tree logs, one line for each
        print("force killing sub process", child.name())
    for child in [*left, psutil.Process(core.pid)]:
        child.kill()
    core.join()
    print("done")
"""


def test_an_engine_slow_to_exit_after_sigterm_has_the_children_of_an_execd_one(tmp_path):
    """vLLM's process manager SIGTERMs its engine core and, 5 s on, SIGKILLs what is left of its process tree, logging
    each process: a launched engine core's nursery (and its workers') is gone once the engine core handles SIGTERM."""
    pytest.importorskip("psutil")
    from tests.core.test_launcher import script_both_ways

    launched, execd = script_both_ways(tmp_path, _SLOW_EXIT, "psutil", timeout=600)
    assert launched.returncode == execd.returncode == 0, (launched, execd)
    assert execd.stdout == "done\n", execd  # the test's premise: an exec'd engine core's worker is joined, nothing left
    assert launched.stdout == execd.stdout, launched
    assert launched.stderr == execd.stderr == "", (launched.stderr, execd.stderr)


def test_a_launcher_for_one_engine_preloads_that_engine_alone():
    """``weightcache launcher --engines vllm`` where SGLang is installed too: a launched process carries everything the
    launcher imported to its exit, where collecting it takes time (decision 114)."""
    from weightcache.core.spare.preload import installed_modules

    every = {name.partition(".")[0] for name in installed_modules()}
    assert {"vllm", "sglang"} <= every, every  # the test's premise: both engines here
    only = {name.partition(".")[0] for name in installed_modules(engines=["vllm"])}
    assert "vllm" in only and "sglang" not in only, only
