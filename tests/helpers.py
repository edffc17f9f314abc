"""Shared test helpers: real server processes, real checkpoints, tensor assertions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import zygote
from weightcache.core.identity.declared import CheckpointFiles
from weightcache.core.identity.digests import RACY_WINDOW_NS
from weightcache.core.server.server_process import ServerProcess

__all__ = ["ServerProcess"]  # one server-process helper for the kit, the demo and the project's tests

EXAMPLE = Path(__file__).parents[1] / "examples" / "tinylm-adapter"
"""The adapter guide's example package, an outside adapter (``weightcache-example``)."""
EXAMPLE_SRC = EXAMPLE / "src"
PLANTED_DIR = Path(__file__).parent / "conformance"
"""Where ``planted_adapters.py`` lies: the example adapter with one planted bug per class."""

EXIT_CASES = [
    ("pass", 0),
    ("import sys; sys.exit(3)", 3),
    ("import sys; sys.exit('a message')", 1),
    ("def f():\n    raise ValueError('boom')\nf()", 1),
    ("raise KeyboardInterrupt", -signal.SIGINT),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
    ("import os; os.abort()", -signal.SIGABRT),
    ("def broken(:", 1),
    ("import atexit, threading, time; atexit.register(print, 'atexit'); "
     "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()", 0),
    ("import sys; sys.stdout.write('unflushed'); open('/dev/null', 'w').write('x')", 0),
]  # fmt: skip
"""``python -c`` programs and the exit status an exec gives each: a process started another way (the test zygote's
fork, the launcher's) must end the same."""

KIT_SUBCLASS = """
import pytest

import planted_adapters
from weightcache.conformance import ConformanceFixtures, ConformanceTests
from weightcache.core.flow.plugins import Plugins


class {test_class}(ConformanceFixtures, ConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def adapter_name(cls):
        return "planted"

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls):
        return {checkpoint!r}

    @pytest.fixture(scope="class")
    @classmethod
    def plugins(cls):
        return Plugins.from_modules({{"planted": planted_adapters.{adapter}}})
"""


def kit_subclass_module(adapter: str, checkpoint: str, test_class: str = "TestPlanted", classes: int = 1) -> str:
    """A test module subclassing the conformance kit, as an author's suite does, for ``planted_adapters.<adapter>``.

    Run it with ``PLANTED_DIR`` and ``EXAMPLE_SRC`` on PYTHONPATH; ``classes`` > 1 adds subclasses that run the kit again.
    """
    source = KIT_SUBCLASS.format(test_class=test_class, checkpoint=str(checkpoint), adapter=adapter)
    return source + "".join(f"\n\nclass {test_class}{n}({test_class}):\n    pass\n" for n in range(2, classes + 1))


class Engine:
    """An engine (tests/engine_child.py) in its own process, driven line by line."""

    def __init__(self, model, socket_dir, mode="client", dtype=None, device="cpu", count_opens=False):
        args = [
            sys.executable,
            "-m",
            "tests.engine_child",
            "--model",
            str(model),
            "--socket-dir",
            str(socket_dir),
            "--mode",
            mode,
            "--device",
            device,
        ] + (["--count-opens"] if count_opens else [])
        if dtype:
            args += ["--dtype", dtype]
        self.proc = zygote.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"engine exited ({self.proc.wait()}): {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.communicate(timeout=60)


def run_python(
    code: str, *args: str, timeout: float = 240, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a real second process; forked from tests/zygote.py's where its rules allow)."""
    proc = zygote.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"child failed (exit {proc.returncode}):\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    return proc


def run_cli(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """``weightcache ARGS`` in a fresh process (tests/zygote.py's rules); with ``check``, a failure shows its output."""
    proc = zygote.run([sys.executable, "-m", "weightcache.core.cli.cli", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"weightcache {' '.join(args)} failed (exit {proc.returncode}):\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-5000:]}"
        )
    return proc


def assert_tensors_equal(name: str, actual, expected) -> None:
    """Bit-exact equality with a message naming the tensor, dtype, device and largest difference."""
    import torch

    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if torch.equal(actual.cpu(), expected.cpu()):
        return
    diff = (actual.detach().cpu().double() - expected.detach().cpu().double()).abs().max().item()
    raise AssertionError(f"{name}: {actual.dtype} on {actual.device} differs from {expected.device}; largest difference {diff:g}")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def open_fd_count(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a rendezvous for torch.distributed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def past_the_racy_window(checkpoint: str | os.PathLike) -> None:
    """Wait until every declared file of ``checkpoint`` (default declaration) last changed (mtime or ctime) longer ago
    than the racy window: a load of files changed just before hashes them but does not remember their digests
    (core/identity/digests.py)."""
    newest = max(max(f.stat().st_mtime_ns, f.stat().st_ctime_ns) for f in CheckpointFiles().files(checkpoint))
    time.sleep(max(0.0, (newest + RACY_WINDOW_NS - time.time_ns()) / 1e9 + 0.01))
