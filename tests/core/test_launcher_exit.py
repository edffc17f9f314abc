"""A launched process's ``spawn`` children share one resource tracker with it, as exec'd ones do: shared memory and
semaphores made and released in them leave nothing to the tracker, whose exit would print ``resource_tracker: There
appear to be N leaked shared_memory objects`` (decision 114)."""

from __future__ import annotations

import pytest

from tests.core.test_launcher import LauncherProcess, script_both_ways

_SHARED_MEMORY = """
import multiprocessing, multiprocessing.util, os, sys
from multiprocessing import resource_tracker, shared_memory
from unittest.mock import patch


class Ring:  # as vLLM's ShmRingBuffer: its creator unlinks in __del__; a reader attaches without registering
    def __init__(self, name=None):
        self.creator = name is None
        if self.creator:
            self.shm = shared_memory.SharedMemory(create=True, size=4096)
        else:
            with patch("multiprocessing.resource_tracker.register", lambda *args, **kwargs: None):
                self.shm = shared_memory.SharedMemory(name=name)

    def __del__(self):
        self.shm.close()
        if self.creator:
            self.shm.unlink()


def worker(name, done):
    reader, own = Ring(name), Ring()
    lock = multiprocessing.get_context("spawn").Lock()  # a semaphore of the worker's own
    with lock:
        reader.shm.buf[0] = 7
    done.put(own.shm.name)
    del reader, own, lock


def engine_core(done):
    ring = Ring()  # as vLLM's rpc_broadcast_mq, made by the engine core and read by its workers
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=worker, args=(ring.shm.name, done)) for _ in range(2)]
    for child in workers:
        child.start()
    for child in workers:
        child.join()
    assert ring.shm.buf[0] == 7
    done.put(resource_tracker._resource_tracker._fd is not None)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    done = context.SimpleQueue()
    core = context.Process(target=engine_core, args=(done,))
    core.start()
    core.join()
    nursery = getattr(multiprocessing.util.spawnv_passfds, "__self__", None)  # a launched process's (children.py)
    print(core.exitcode, sorted(type(done.get()).__name__ for _ in range(3)), len(nursery.forked) if nursery else "-")
"""


def test_a_launched_engines_spawn_children_leave_the_resource_tracker_what_execd_ones_leave(tmp_path):
    """vLLM's pattern at TP=2: the engine core makes a block its workers attach to, each worker makes its own; every
    block is unlinked in ``__del__``, the tracker (started by the engine for its first spawn child) sees each one go."""
    launched, execd = script_both_ways(tmp_path, _SHARED_MEMORY, "multiprocessing.shared_memory", timeout=300)
    assert execd.returncode == 0 and execd.stdout == "0 ['bool', 'str', 'str'] -\n", execd  # the test's premise
    assert launched.returncode == 0 and launched.stdout == "0 ['bool', 'str', 'str'] 2\n", launched  # tracker, core forked
    assert launched.stderr == execd.stderr == "", (launched.stderr, execd.stderr)


def test_the_launcher_preloads_only_the_engines_named():
    """``--engines``: an engine left out is not preloaded; a name the launcher does not know is refused, saying which
    it knows."""
    from weightcache.core.errors import LauncherError
    from weightcache.core.spare import preload

    assert not {"vllm", "sglang"} & set(preload.installed_modules(engines=[]))
    with pytest.raises(LauncherError, match="vlm is not an engine the launcher knows; name some of sglang, vllm"):
        preload.installed_modules(engines=["vlm"])


def test_a_launcher_asked_for_an_engine_it_does_not_know_says_which_it_knows(tmp_path):
    started = LauncherProcess(tmp_path / "sock", "--engines", "vllm,vlm", "--no-warm")
    try:
        assert started.ready is None
        assert started.proc.wait(timeout=120) != 0
        assert "vlm is not an engine the launcher knows; name some of sglang, vllm" in started.output()
    finally:
        started.stop()
