"""benchmarks/engine_start.py's probe of torch's distributed init, in every process of an engine (its own children too).

Put on ``PYTHONPATH`` with ``ENGINE_START_DIST_LOG=FILE``: once ``torch.distributed`` is imported, its
``init_process_group`` and ``new_group`` are timed, and each call appends a JSON line (pid, what, seconds) to FILE.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

_LOG = os.environ.get("ENGINE_START_DIST_LOG")


def _timed(module, name):
    inner = getattr(module, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            line = {"pid": os.getpid(), "what": name, "s": time.perf_counter() - start}
            with open(_LOG, "a") as log:
                log.write(json.dumps(line) + "\n")

    timed.__wrapped__ = inner
    return timed


def _patch(distributed):
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    for name in ("init_process_group", "new_group"):
        wrapped = _timed(c10d, name)
        setattr(c10d, name, wrapped)
        setattr(distributed, name, wrapped)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``_patch`` once ``torch.distributed`` has been executed."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                _patch(module)

        spec.loader = Loader()
        return spec


if _LOG:
    sys.meta_path.insert(0, _AfterImport())
