"""In a child forked from a launcher: take the caller's process state and run its target as ``python`` would.

``become`` gives the child what ``exec`` would have: its own session, the caller's fds on their numbers (every other
fd closed), environment, working directory, umask, signal dispositions and mask, resource limits and niceness; then
fresh interpreter state where the launcher's would show (``sys.argv``, ``sys.path``, ``__main__``, standard streams,
warning filters, logging, random seeds). ``run_target`` runs the module, code or script and ends the process through
the interpreter's own exit (threads joined, ``atexit``, ``SystemExit``'s status; an uncaught exception's traceback
without the launcher's frames and status 1; ``KeyboardInterrupt``'s SIGINT).
"""

from __future__ import annotations

import atexit
import builtins
import fcntl
import gc
import importlib
import importlib.machinery
import io
import linecache
import logging
import os
import resource
import runpy
import signal
import socket
import sys
import threading
import types
import typing
import warnings

from weightcache.core.spare.environment import bind_as_libgomp
from weightcache.core.wire.launch_request import LaunchRequest, Target
from weightcache.core.wire.protocol import error_reply, ok_reply, send_frame

if typing.TYPE_CHECKING:
    from weightcache.core.spare.preload import Preloaded

_DEFAULT_IGNORED = (signal.SIGPIPE, signal.SIGXFSZ)
"""What the interpreter itself ignores at start."""


def become(
    request: LaunchRequest, fds: list[int], channel: socket.socket, session: bool = True, keep: frozenset[int] = frozenset()
) -> None:
    """Take the caller's process state and tell the caller on ``channel`` (then closed); a child that cannot take it
    says why there and exits with status 255. ``session``: lead a session of its own (an engine); without it, stay in
    the parent's (an engine's own child, as its exec'd children stay). ``keep``: fds of the child's own that stay open
    (a CUDA context's, made before the request: none of them is one of the request's numbers)."""
    channel_fd = channel.detach()
    try:
        channel_fd = _take_state(request, fds, channel_fd, session, keep)
        reply = ok_reply(pid=os.getpid(), started=True)
    except (OSError, ValueError) as exc:  # setrlimit says ValueError where the kernel refuses a limit
        reply = error_reply(
            "start_failed", f"the engine could not take the caller's state: {exc}", errno=getattr(exc, "errno", None)
        )
    told = socket.socket(fileno=channel_fd)
    try:
        send_frame(told, reply)
    except OSError:
        pass
    finally:
        told.close()
    if not reply["ok"]:
        os._exit(255)


def _take_state(request: LaunchRequest, fds: list[int], channel_fd: int, session: bool, keep: frozenset[int]) -> int:
    """Session, umask, cwd, fds, environment, limits, niceness and signals of the caller; returns the channel's fd."""
    if session:
        os.setsid()
    os.umask(request.umask)
    os.chdir(request.cwd)
    targets = list(request.fds)
    above = max([*targets, 2]) + 1  # copies go above every target, so that no dup2 below overwrites one
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    channel_fd = fcntl.fcntl(channel_fd, fcntl.F_DUPFD_CLOEXEC, max([*high, above]) + 1)
    for source, target in zip(high, targets, strict=True):
        os.dup2(source, target, inheritable=True)
    low = 0
    for fd in sorted({*targets, channel_fd, *keep}):  # everything else goes, as close_fds does
        if low < fd:  # os.closerange(n, n) would close from n upwards
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    os.environ.clear()
    os.environ.update(request.env)
    bind_as_libgomp(request.env)
    for name, (soft, hard) in request.limits.items():
        limit = getattr(resource, name, None)
        if limit is not None and resource.getrlimit(limit) != (soft, hard):
            resource.setrlimit(limit, (soft, hard))
    if os.getpriority(os.PRIO_PROCESS, 0) != request.nice:
        os.setpriority(os.PRIO_PROCESS, 0, request.nice)
    _reset_signals(request)
    return channel_fd


def _reset_signals(request: LaunchRequest) -> None:
    """Dispositions as a fresh interpreter of the caller has them, then the caller's mask."""
    signal.set_wakeup_fd(-1)
    ignored = set(request.ignored) | set(_DEFAULT_IGNORED)
    for sig in signal.Signals:
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if sig in ignored:
                signal.signal(sig, signal.SIG_IGN)
            elif sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            else:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, request.blocked)


def fresh_state(target: Target, preloaded: Preloaded) -> types.ModuleType:
    """Interpreter state as ``python`` gives it before the target runs; returns the new ``__main__``."""
    for name, value in preloaded.set_by_imports.items():
        os.environ.setdefault(name, value)
    _fresh_streams()
    settle(preloaded)
    importlib.invalidate_caches()
    _fresh_module_state()
    sys.path[:] = [*_first_path_entry(target), *preloaded.fresh.path]
    sys.argv = target.argv
    sys.orig_argv = [sys.executable, *_python_args(target)]
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __package__=None,
        __loader__=importlib.machinery.BuiltinImporter,
        __spec__=None,
        __annotations__={},
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    return main


def _first_path_entry(target: Target) -> list[str]:
    """What ``python`` puts before its path: ``""`` for ``-c``, the working directory for ``-m`` (nothing where it was
    removed), the script's directory for a script (``""`` where its path cannot be resolved: it cannot be opened)."""
    if target.form == "code":
        return [""]
    try:
        if target.form == "module":
            return [os.getcwd()]
        return [os.path.dirname(os.path.realpath(target.value))]
    except FileNotFoundError:  # the working directory was removed
        return [] if target.form == "module" else [""]


def settle(preloaded: Preloaded) -> None:
    """The part of ``fresh_state`` that needs no request: no logging handler of the launcher's, warning filters as the
    imports left them, an empty line cache, seeds from the OS. A child forked ahead of a request runs it while it
    waits (it writes to pages the fork shares, which are copied then); ``fresh_state`` runs it again, finding it done."""
    logging.shutdown()  # flush, then forget the launcher's handlers
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    typing.cast(list, warnings.filters)[:] = preloaded.filters  # in place: the C module holds the same list
    warnings._filters_mutated()  # type: ignore[attr-defined]
    linecache.clearcache()
    _reseed()


def _python_args(target: Target) -> list[str]:
    head = {"module": ["-m", target.value], "code": ["-c", target.value], "script": [target.value]}[target.form]
    return [*head, *target.args]


def _fresh_streams() -> None:
    """Standard streams as the interpreter opens them on the new fds 0-2 (line-buffered where they are terminals)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    unbuffered = getattr(sys.stdout, "write_through", False)  # -u or PYTHONUNBUFFERED, the launcher's as the caller's
    for name, fd in (("stdin", 0), ("stdout", 1)):  # stderr is line-buffered (or written through) wherever it goes
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and stream.fileno() == fd:
            stream.reconfigure(line_buffering=_isatty(fd) and not unbuffered)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _reseed() -> None:
    """A fresh interpreter seeds ``random``, numpy's global generator and torch's CPU generator from the OS; a fork
    would share the launcher's seeds with every sibling."""
    random = sys.modules.get("random")
    if random is not None:
        random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def _fresh_module_state() -> None:
    """Module globals the preloads computed from the launcher's process at import: multiprocessing's start directory
    (spawn resolves a relative main script against it) is the engine's, as its own import would have found it."""
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        try:
            process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # type: ignore[attr-defined]
        except OSError:  # as multiprocessing's own import sets it in a removed working directory
            process.ORIGINAL_DIR = None  # type: ignore[attr-defined]


def run_target(target: Target, main: types.ModuleType) -> typing.NoReturn:
    """Run ``target`` in ``main``; never returns: a SystemExit ends the interpreter as ``python``'s own would."""
    atexit.register(_unfreeze_for_nanobind)  # registered first, so it runs after every handler of the target
    try:
        if target.form == "module":
            runpy._run_module_as_main(target.value, alter_argv=True)  # type: ignore[attr-defined]
        else:
            code = _compile(target, main)
            exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _report_uncaught(exc)
        if isinstance(exc, KeyboardInterrupt):
            _exit_by_sigint()
        raise SystemExit(1) from None
    raise SystemExit(0)


def _unfreeze_for_nanobind() -> None:
    """Give the interpreter's exit the objects the launcher froze, where a nanobind extension (Triton's) is loaded.

    Frozen objects are never collected, and nanobind reports each of its objects still alive at exit as a leak
    (~30 lines of ``nanobind: leaked ...`` with Triton) that an exec'd interpreter, which frees them, never prints.
    The exit then collects them as an exec'd one does (seconds where vLLM or SGLang is loaded, as exec'd).
    """
    import ctypes

    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_GetDict.restype = ctypes.py_object
    api.PyInterpreterState_GetDict.argtypes = [ctypes.c_void_p]
    try:
        names = list(api.PyInterpreterState_GetDict(api.PyInterpreterState_Get()))
    except (ValueError, TypeError):  # no interpreter dict (NULL)
        return
    if any(isinstance(name, str) and name.startswith("__nb_internals_") for name in names):
        gc.unfreeze()


def _compile(target: Target, main: types.ModuleType) -> types.CodeType:
    if target.form == "code":
        source: str | bytes = target.value
        filename = "<string>"
    else:
        filename = target.value
        try:
            with open(filename, "rb") as file:
                source = file.read()
        except OSError as exc:
            try:
                shown = os.path.abspath(filename)
            except OSError:  # a removed working directory: the interpreter names the path as given
                shown = filename
            print(f"{sys.executable}: can't open file {shown!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
        main.__dict__.update(__file__=filename, __cached__=None)
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", filename)
    try:
        return compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:  # as the interpreter reports a target it cannot compile: no traceback, status 1
        sys.excepthook(type(exc), exc.with_traceback(None), None)
        raise SystemExit(1) from None


def _report_uncaught(exc: BaseException) -> None:
    """Print ``exc`` as the interpreter does, from the target's first frame (the launcher's frames left out)."""
    tb = exc.__traceback__
    here = run_target.__code__
    while tb is not None and tb.tb_frame.f_code is not here:
        tb = tb.tb_next
    tb = tb.tb_next if tb is not None else exc.__traceback__
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _exit_by_sigint() -> typing.NoReturn:
    """What the interpreter does after an uncaught KeyboardInterrupt: finish (threads, ``atexit``), then die by SIGINT."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)
