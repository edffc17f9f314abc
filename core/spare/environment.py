"""Which environment variables a launcher's preloaded code depends on, and where a caller's environment differs on them.

A name is a dependency when the imports read it by name (``os.environ[...]``, ``get``, ``in``, ``os.getenv``,
recorded while they run) or when it matches a prefix that code reads where recording cannot see it
(``READ_OUTSIDE_PYTHON``: C libraries, scans for a prefix). A copy of the whole environment is no read of each name:
CPython's ``platform`` helpers copy it to run a command (py-cpuinfo calls one at import), as does any
``dict(os.environ)``; such a copy lists the names, then reads every one in that order, which is what recording skips.
Nor is ``PATH`` where ``subprocess`` reads it to find the command it runs.
The names of a caller's session (``SESSION_NAMES``: the shell's, the terminal's, the service manager's) never count,
however they are read: they say where a process runs, not what it runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import typing
from collections.abc import Iterator, Mapping

READ_OUTSIDE_PYTHON = (
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "LD_", "MALLOC_", "LANG", "LC_", "TORCH", "PYTORCH_", "TQDM_",
    "CUDA_MODULE_LOADING",
)  # fmt: skip
"""Environment names (prefixes) the imports may read where recording cannot see them: in C (OpenMP, BLAS, the
interpreter, libtorch's static initialisers) or by scanning the whole environment (tqdm's ``TQDM_``). A caller whose
value differs from the launcher's on any of them is exec'd."""
SESSION_NAMES = frozenset(
    {
        # the shell's
        "_", "SHLVL", "PWD", "OLDPWD", "LS_COLORS", "LESSOPEN", "LESSCLOSE", "MAIL",
        # the terminal's
        "TERM", "TERMCAP", "COLORTERM", "COLUMNS", "LINES", "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "TERM_SESSION_ID",
        "TMUX", "TMUX_PANE", "STY", "WINDOW", "WINDOWID", "VTE_VERSION", "LC_TERMINAL", "LC_TERMINAL_VERSION",
        # the login's and the service manager's (systemd's per-unit names)
        "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_SESSION_CLASS", "XDG_VTNR", "XDG_SEAT", "INVOCATION_ID",
        "JOURNAL_STREAM", "MANAGERPID", "SYSTEMD_EXEC_PID", "NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC",
        "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "MAINPID",
    }
)  # fmt: skip
"""Names that say where a process runs (its shell, terminal, login or service), never what it runs: a caller that
differs on them is forked, whatever the imports read."""
SESSION_PREFIXES = ("SSH_", "KONSOLE_", "ITERM_", "WT_")
BOUND_AFTER_FORK = "GOMP_CPU_AFFINITY"
"""libgomp reads it once, as it loads, and binds the loading thread to its first CPU. Where it names one CPU, a forked
child bound to that CPU (``bind_as_libgomp``) is what an exec'd one is, so a caller that differs on it is forked: vLLM
gives each CPU worker its own (``0|1`` two ranks of one CPU each)."""
"""Prefixes of ``SESSION_NAMES``' kind (an SSH login's ``SSH_CONNECTION``, ``SSH_TTY``; terminal emulators' own)."""


def one_cpu(value: str | None) -> int | None:
    """The CPU a ``GOMP_CPU_AFFINITY`` value names where it names exactly one (``"3"``), else None."""
    text = (value or "").strip()
    return int(text) if text.isdigit() else None


def bound_after_fork(launcher_env: Mapping[str, str], caller_env: Mapping[str, str]) -> bool:
    """Whether a fork takes the caller's ``GOMP_CPU_AFFINITY`` as its exec would: the caller's names one CPU, and the
    launcher's is unset or names one too (libgomp then has one place, or none, and every thread it starts inherits the
    binding of the thread that starts it)."""
    launcher = launcher_env.get(BOUND_AFTER_FORK)
    return one_cpu(caller_env.get(BOUND_AFTER_FORK)) is not None and (launcher is None or one_cpu(launcher) is not None)


def bind_as_libgomp(env: Mapping[str, str]) -> None:
    """In a forked child with ``env``: bind this (the only) thread to the CPU ``GOMP_CPU_AFFINITY`` names, as libgomp
    binds the thread that loads it. Where libgomp is not loaded yet it reads the variable itself when it loads."""
    cpu = one_cpu(env.get(BOUND_AFTER_FORK))
    if cpu is not None and _libgomp_loaded():
        os.sched_setaffinity(0, {cpu})


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


def is_session_name(name: str) -> bool:
    return name in SESSION_NAMES or name.startswith(SESSION_PREFIXES)


class _Reads:
    """The names read one by one; a listing of every name followed by a read of each in its order is a copy."""

    def __init__(self, sink: set[str]):
        self.sink = sink
        self.listing: list[str] = []
        self.at = 0
        """How many of ``listing``'s names were read in order since it was made."""

    def listed(self, names: list[str]) -> None:
        self.flush()
        self.listing = names

    def read(self, name: str) -> None:
        if self.at < len(self.listing) and self.listing[self.at] == name:
            self.at += 1
            if self.at == len(self.listing):  # every name, in order: a copy
                self.listing, self.at = [], 0
            return
        self.flush()
        self.sink.add(name)

    def flush(self) -> None:
        """The names read in order so far were reads of their own (no copy followed)."""
        self.sink.update(self.listing[: self.at])
        self.listing, self.at = [], 0


@contextlib.contextmanager
def recording_reads(sink: set[str]) -> Iterator[None]:
    """Add to ``sink`` every name read through ``os.environ`` (``[]``, ``get``, ``in``, ``os.getenv``) meanwhile. A scan of
    the whole environment (``items()``, ``values()``) or a copy of it (``dict(os.environ)``, ``os.environ.copy()``,
    ``{**os.environ}``) is no read of each name: ``READ_OUTSIDE_PYTHON`` names the prefixes scans look for."""
    environ_type = type(os.environ)
    original_get, original_iter = environ_type.__getitem__, environ_type.__iter__
    reads = _Reads(sink)

    def recorded(self: typing.Any, key: typing.Any) -> typing.Any:
        caller = sys._getframe(1)
        if caller.f_code.co_name != "__iter__" and not _finds_a_command(caller):  # items(), values(): their iteration
            reads.read(os.fsdecode(key))  # os.environb's names are bytes
        return original_get(self, key)

    def listing(self: typing.Any) -> Iterator[str]:
        names = list(original_iter(self))
        reads.listed([os.fsdecode(name) for name in names])
        yield from names

    environ_type.__getitem__ = recorded  # type: ignore[method-assign]
    environ_type.__iter__ = listing  # type: ignore[method-assign]
    try:
        yield
    finally:
        environ_type.__getitem__ = original_get  # type: ignore[method-assign]
        environ_type.__iter__ = original_iter  # type: ignore[method-assign]
        reads.flush()


def _finds_a_command(frame: types.FrameType | None) -> bool:
    """Whether this read is ``os.get_exec_path`` looking a command up on ``PATH`` for ``subprocess`` (CPython's
    ``platform`` runs ``uname -p`` and ``file`` at import to describe the machine): which copy of a standard tool
    described it is no more a dependency than the copy of the environment handed to it."""
    for _ in range(3):  # get_exec_path -> Mapping.get -> __getitem__
        if frame is None:
            return False
        if frame.f_code is os.get_exec_path.__code__:
            return True
        frame = frame.f_back
    return False


def differences(
    read: typing.Iterable[str],
    launcher_env: Mapping[str, str],
    caller_env: Mapping[str, str],
    set_by_imports: Mapping[str, str] | None = None,
) -> list[str]:
    """The dependencies (``read``, and every name under ``READ_OUTSIDE_PYTHON``) on which ``caller_env`` differs from
    ``launcher_env``, sorted, leaving out the session's names and those the imports set where the launcher had none
    (a caller with the value they set has what its own import would have given it) and a ``GOMP_CPU_AFFINITY`` a fork
    takes as its exec would (``bound_after_fork``)."""
    set_by_imports = set_by_imports or {}
    names = set(read) | {n for n in caller_env.keys() | launcher_env.keys() if n.startswith(READ_OUTSIDE_PYTHON)}
    return sorted(
        n
        for n in names
        if caller_env.get(n) != launcher_env.get(n)
        and not is_session_name(n)
        and not (n in set_by_imports and n not in launcher_env and caller_env.get(n) == set_by_imports[n])
        and not (n == BOUND_AFTER_FORK and bound_after_fork(launcher_env, caller_env))
    )
