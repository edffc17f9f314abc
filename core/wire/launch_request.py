"""What a caller asks a launcher for: the engine's command line and the process state ``exec`` would have given it.

``LaunchRequest`` is parsed once where it enters (the launcher reads it from a frame) and passed typed from there;
``Target`` is the part of the command line that says what runs (``-m MODULE``, ``-c CODE`` or a script).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import typing

import attrs

from weightcache.core.errors import LaunchRefused
from weightcache.core.socket_dir import SocketDir

LAUNCHER_SOCKET_NAME = "launcher.sock"
SETTABLE_LIMITS = tuple(
    name for name in sorted(dir(resource)) if name.startswith("RLIMIT_") and name not in ("RLIMIT_NLIMITS", "RLIMIT_STACK")
)
"""The resource limits a child takes from its caller (the stack's is fixed where the interpreter started)."""


def launcher_socket(socket_dir: SocketDir) -> str:
    """The launcher's socket: ``launcher.sock`` in the server's private directory."""
    return str(socket_dir.path / LAUNCHER_SOCKET_NAME)


@attrs.frozen
class Target:
    """What runs: ``form`` is ``module`` (``-m``), ``code`` (``-c``) or ``script``; ``value`` the module, code or path."""

    form: str
    value: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, argv: typing.Sequence[str], cwd: str = "") -> Target:
        """``argv`` as ``python`` reads it after its own name (a relative script is ``cwd``'s, the caller's); LaunchRefused
        (``target``) for what only an exec gives."""
        if not argv:
            raise LaunchRefused("target", "no command: give the arguments of `python`, e.g. `-m my_engine.serve --model M`")
        first = argv[0]
        if first in ("-m", "-c"):
            if len(argv) < 2:
                raise LaunchRefused("target", f"`python {first}` needs an argument")
            return cls("module" if first == "-m" else "code", argv[1], tuple(argv[2:]))
        if first.startswith("-"):
            raise LaunchRefused("target", f"the interpreter option {first!r} is not forked from a launcher")
        if os.path.isdir(os.path.join(cwd, first)) or first.endswith((".zip", ".pyz")):
            raise LaunchRefused("target", f"{first} is a directory or an archive; a launcher forks scripts and modules only")
        return cls("script", first, tuple(argv[1:]))

    @property
    def argv(self) -> list[str]:
        """``sys.argv`` as ``python`` sets it before the target runs (runpy fills in a module's path)."""
        return [{"module": "-m", "code": "-c", "script": self.value}[self.form], *self.args]


def _strings(values: typing.Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _numbers(values: typing.Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class LaunchRequest:
    """The caller's state that an exec'd engine would inherit.

    :param argv: the arguments of ``python`` (no interpreter name).
    :param fds: the fd numbers the engine gets, in the order the fds travel (0, 1, 2, then inherited ones).
    :param ignored: signals ignored where the caller started (an exec keeps them ignored).
    :param blocked: the caller's signal mask.
    :param limits: resource limits, ``RLIMIT_* -> [soft, hard]``.
    """

    argv: tuple[str, ...] = attrs.field(converter=_strings)
    env: dict[str, str]
    cwd: str
    umask: int
    fds: tuple[int, ...] = attrs.field(converter=_numbers)
    ignored: tuple[int, ...] = attrs.field(converter=_numbers, default=())
    blocked: tuple[int, ...] = attrs.field(converter=_numbers, default=())
    limits: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    nice: int = 0
    executable: str = ""
    prefix: str = ""
    """The caller's ``sys.prefix``: two venvs of one interpreter share ``executable`` but not their packages."""

    @classmethod
    def of_this_process(cls, argv: typing.Sequence[str], env: dict[str, str], fds: typing.Sequence[int]) -> LaunchRequest:
        """The request a caller makes for itself: its cwd, umask, signal state, limits and niceness."""
        umask = os.umask(0)
        os.umask(umask)
        ignored = [int(s) for s in signal.Signals if s not in _UNCATCHABLE and signal.getsignal(s) is signal.SIG_IGN]
        return cls(
            argv=argv,
            env=env,
            cwd=working_directory(),
            umask=umask,
            fds=fds,
            ignored=ignored,
            blocked=sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            limits={name: resource.getrlimit(getattr(resource, name)) for name in SETTABLE_LIMITS},
            nice=os.getpriority(os.PRIO_PROCESS, 0),
            executable=_executable(),
            prefix=sys.prefix,
        )

    def to_message(self) -> dict:
        return {"op": "launch", **{f.name: getattr(self, f.name) for f in attrs.fields(LaunchRequest)}}

    @classmethod
    def from_message(cls, message: dict, nfds: int) -> LaunchRequest:
        """The request in a frame, every field checked for its type and range; LaunchRequest (``bad_request``) names the
        first field that is not what a caller of this version sends (one line)."""
        fields = _Fields(message)
        request = cls(
            argv=fields.strings("argv"),
            env=fields.environment("env"),
            cwd=fields.path("cwd"),
            umask=fields.integer("umask", 0, 0o777),
            fds=fields.integers("fds", 0, MAX_FD),
            ignored=fields.signals("ignored"),
            blocked=fields.signals("blocked"),
            limits=fields.limits("limits"),
            nice=fields.integer("nice", -20, 19, default=0),
            executable=fields.text("executable", default=""),
            prefix=fields.text("prefix", default=""),
        )
        if len(request.fds) != nfds or len(set(request.fds)) != nfds:
            raise LaunchRefused("bad_request", f"the request names fds {list(request.fds)[:8]} but carried {nfds}")
        return request


MAX_FD = (1 << 20) - 1
"""The highest fd number a request may name (the kernel's default ``fs.nr_open`` bounds any process's table)."""
RLIM_MAX = (1 << 63) - 1
"""The largest limit ``resource.setrlimit`` takes (``-1`` is ``RLIM_INFINITY``)."""
_REQUIRED = object()


class _Fields:
    """Reads a launch request's fields with their types and ranges checked: LaunchRefused (``bad_request``) otherwise.
    JSON admits what no caller sends (``Infinity``, ``NaN``, ``1e400``, numbers beyond any range, strings with NUL)."""

    def __init__(self, message: dict):
        self.message = message

    def _get(self, name: str, default: typing.Any) -> typing.Any:
        if name in self.message:
            return self.message[name]
        if default is _REQUIRED:
            self.refuse(name, "is missing")
        return default

    @staticmethod
    def refuse(name: str, what: str) -> typing.NoReturn:
        raise LaunchRefused(
            "bad_request", f"malformed launch request: {name} {what}; run `weightcache launch` of the launcher's version"
        )

    def integer(self, name: str, low: int, high: int, default: typing.Any = _REQUIRED, value: typing.Any = _REQUIRED) -> int:
        value = self._get(name, default) if value is _REQUIRED else value
        if type(value) is not int or not low <= value <= high:  # bool, float (inf, nan, 1e400) and str are refused
            self.refuse(name, f"must be an integer from {low} to {high}, not {_short(value)}")
        return value

    def text(self, name: str, default: typing.Any = _REQUIRED, value: typing.Any = _REQUIRED) -> str:
        value = self._get(name, default) if value is _REQUIRED else value
        if not isinstance(value, str) or "\0" in value:
            self.refuse(name, f"must be a string without NUL, not {_short(value)}")
        return value

    def _list(self, name: str, default: typing.Any = _REQUIRED) -> list:
        value = self._get(name, default)
        if not isinstance(value, list):
            self.refuse(name, f"must be a list, not {_short(value)}")
        return value

    def strings(self, name: str) -> list[str]:
        return [self.text(name, value=v) for v in self._list(name)]

    def integers(self, name: str, low: int, high: int, default: typing.Any = _REQUIRED) -> list[int]:
        return [self.integer(name, low, high, value=v) for v in self._list(name, default)]

    def signals(self, name: str) -> list[int]:
        numbers = self.integers(name, 1, signal.NSIG - 1, default=[])
        valid = signal.valid_signals()
        for number in numbers:
            if number not in valid:
                self.refuse(name, f"names {number}, which is not a signal here")
        return numbers

    def path(self, name: str) -> str:
        value = self.text(name)
        if not value.startswith("/"):
            self.refuse(name, f"must be an absolute path, not {_short(value)}")
        return value

    def environment(self, name: str) -> dict[str, str]:
        value = self._get(name, _REQUIRED)
        if not isinstance(value, dict):
            self.refuse(name, f"must be an object, not {_short(value)}")
        for key, item in value.items():
            if not key or "=" in key or "\0" in key:
                self.refuse(name, f"holds the name {_short(key)}, which an environment cannot")
            self.text(f"{name}[{key[:40]!r}]", value=item)
        return dict(value)

    def limits(self, name: str) -> dict[str, tuple[int, int]]:
        value = self._get(name, {})
        if not isinstance(value, dict):
            self.refuse(name, f"must be an object, not {_short(value)}")
        limits = {}
        for key, pair in value.items():
            if key not in SETTABLE_LIMITS:
                self.refuse(name, f"names {_short(key)}, which is not a limit a caller passes on")
            if not isinstance(pair, list) or len(pair) != 2:
                self.refuse(f"{name}[{key}]", f"must be [soft, hard], not {_short(pair)}")
            soft, hard = (self.integer(f"{name}[{key}]", -1, RLIM_MAX, value=v) for v in pair)
            if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft > hard):
                self.refuse(f"{name}[{key}]", f"has a soft limit {soft} above its hard limit {hard}")
            limits[key] = (soft, hard)
        return limits


def _short(value: typing.Any) -> str:
    """``value`` as a refusal line quotes it: one line, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def working_directory() -> str:
    """This process's working directory; where it was removed, the link to it in ``/proc`` (an engine started there
    stays in it, as an exec'd one would, and ``os.getcwd()`` fails for it as for this process)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return f"/proc/{os.getpid()}/cwd"


def _executable() -> str:
    return os.path.realpath(sys.executable)


def initial_environment() -> dict[str, str]:
    """The environment this process was exec'd with (``/proc/self/environ``), whatever it has set since; where that
    cannot be read (a process that changed its uid is not dumpable), ``os.environ``."""
    try:
        with open("/proc/self/environ", "rb") as file:
            entries = file.read().split(b"\0")
    except PermissionError:
        return dict(os.environ)
    env = {}
    for entry in entries:
        name, sep, value = entry.partition(b"=")
        if sep:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env
