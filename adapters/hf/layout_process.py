"""Learning a model's layout in a process of its own, while ``weightcache load`` imports torch and reads the disk.

On a node's first model of an architecture the CLI had to build the transformers skeleton itself:
transformers' imports (thousands of modules, longer than reading the checkpoint) ran in a thread beside the
main thread's torch import, CUDA set-up and read, all of them taking turns at one interpreter lock,
and the load waited for them. A child process on a core of its own builds the skeleton instead,
takes its ``Layout`` (the same code as a load in this process) and writes it to its stdout; the load
builds the module tree from it as from a remembered layout, and this process never imports
transformers. The layout is checked as any remembered one (``Layout.from_json``, then one to one
against the checkpoint's tensors), and it is remembered only after the load bound the checkpoint to
it. Where the child fails, is slow or is not wanted, the load builds the skeleton itself, as before
.

Used where the process may run on 4 CPUs or more (a child on a 2-core machine would take the
cores the load needs); ``$WEIGHTCACHE_LAYOUT_PROCESS`` = 1 or 0 forces it on or off.
"""

from __future__ import annotations

import atexit
import json
import logging
import subprocess
import sys
import threading
import typing

from weightcache.adapter import env_switch, usable_cpus

if typing.TYPE_CHECKING:
    from weightcache.adapter import LoadRequest
    from weightcache.adapters.hf.layout import Layout

log = logging.getLogger(__name__)

ENV = "WEIGHTCACHE_LAYOUT_PROCESS"
CHILD = "weightcache.adapters.hf.layout_child"
"""The module the child runs (``python -m``)."""
MIN_CPUS = 4
WAIT_S = 300.0
"""How long a load waits for the child's layout before it builds the skeleton itself."""


def wanted() -> bool:
    """``$WEIGHTCACHE_LAYOUT_PROCESS`` where it is 0 or 1, else whether this process may run on ``MIN_CPUS`` or more."""
    configured = env_switch(ENV)
    return usable_cpus() >= MIN_CPUS if configured is None else configured


class LayoutProcess:
    """A child process learning the layout of ``request``'s model; :meth:`result` waits for it."""

    def __init__(self, request: "LoadRequest"):
        arguments = {
            "model": request.model,
            "dtype": request.dtype,
            "quantization": request.quantization,
            "options": [list(pair) for pair in request.options],
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", CHILD, json.dumps(arguments)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._output: tuple[bytes, bytes] | None = None
        self._lock = threading.Lock()

    def result(self, timeout: float = WAIT_S) -> "Layout | None":
        """The child's layout, or None (it failed, printed no layout, or ran past ``timeout``: logged, then stopped)."""
        from weightcache.adapters.hf.layout import Layout
        from weightcache.adapters.hf.layout_key import MAX_ENTRY_BYTES

        with self._lock:
            if self._output is None:
                try:
                    self._output = self.process.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.info("the layout process ran past %.0f s; building the skeleton here", timeout)
                    self.stop()
                    return None
        out, err = self._output
        if self.process.returncode != 0 or not out or len(out) > MAX_ENTRY_BYTES:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            log.info("the layout process ended with status %s (%s); building the skeleton here", self.process.returncode, tail[0])
            return None
        try:
            return Layout.from_json(out)
        except ValueError as exc:
            log.info("the layout process printed no usable layout (%s); building the skeleton here", exc)
            return None

    def stop(self) -> None:
        """End the child (if it still runs) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            pass


_started: dict[str, LayoutProcess] = {}
_started_lock = threading.Lock()


def start(request: "LoadRequest", key: str) -> None:
    """Start learning the layout stored under ``key`` in a child (once per key), for :func:`take`."""
    with _started_lock:
        if key in _started:
            return
        if not _started:
            atexit.register(stop_all)
        _started[key] = LayoutProcess(request)
    log.debug("learning the model's layout in a process of its own (pid %d)", _started[key].process.pid)


def take(key: str) -> LayoutProcess | None:
    """The child started for ``key``, if any (it is the caller's from here on)."""
    with _started_lock:
        return _started.pop(key, None)


def stop_all() -> None:
    """End every child nobody took (a load that found its entry held never needs its layout)."""
    with _started_lock:
        left = list(_started.values())
        _started.clear()
    for child in left:
        child.stop()
