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
    def parse(cls, argv: typing.Sequence[str]) -> Target:
        """``argv`` as ``python`` reads it after its own name; LaunchRefused (``target``) for what only an exec gives."""
        if not argv:
            raise LaunchRefused("target", "no command: give the arguments of `python`, e.g. `-m my_engine.serve --model M`")
        first = argv[0]
        if first in ("-m", "-c"):
            if len(argv) < 2:
                raise LaunchRefused("target", f"`python {first}` needs an argument")
            return cls("module" if first == "-m" else "code", argv[1], tuple(argv[2:]))
        if first.startswith("-"):
            raise LaunchRefused("target", f"the interpreter option {first!r} is not forked from a launcher")
        if os.path.isdir(first) or first.endswith((".zip", ".pyz")):
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

    @classmethod
    def of_this_process(cls, argv: typing.Sequence[str], env: dict[str, str], fds: typing.Sequence[int]) -> LaunchRequest:
        """The request a caller makes for itself: its cwd, umask, signal state, limits and niceness."""
        umask = os.umask(0)
        os.umask(umask)
        ignored = [int(s) for s in signal.Signals if s not in _UNCATCHABLE and signal.getsignal(s) is signal.SIG_IGN]
        return cls(
            argv=argv,
            env=env,
            cwd=os.getcwd(),
            umask=umask,
            fds=fds,
            ignored=ignored,
            blocked=sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            limits={name: resource.getrlimit(getattr(resource, name)) for name in SETTABLE_LIMITS},
            nice=os.getpriority(os.PRIO_PROCESS, 0),
            executable=_executable(),
        )

    def to_message(self) -> dict:
        return {"op": "launch", **{f.name: getattr(self, f.name) for f in attrs.fields(LaunchRequest)}}

    @classmethod
    def from_message(cls, message: dict, nfds: int) -> LaunchRequest:
        """The request in a frame; LaunchRefused (``target``) names what is malformed."""
        try:
            request = cls(
                argv=[str(a) for a in message["argv"]],
                env={str(k): str(v) for k, v in dict(message["env"]).items()},
                cwd=str(message["cwd"]),
                umask=int(message["umask"]),
                fds=[int(fd) for fd in message["fds"]],
                ignored=[int(s) for s in message.get("ignored", ())],
                blocked=[int(s) for s in message.get("blocked", ())],
                limits={str(k): (int(v[0]), int(v[1])) for k, v in dict(message.get("limits", {})).items()},
                nice=int(message.get("nice", 0)),
                executable=str(message.get("executable", "")),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise LaunchRefused("target", f"malformed launch request ({exc!r}); run the same weightcache version") from None
        if len(request.fds) != nfds or len(set(request.fds)) != nfds or any(fd < 0 for fd in request.fds):
            raise LaunchRefused("target", f"the request names fds {list(request.fds)} but carried {nfds}")
        return request


_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


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
