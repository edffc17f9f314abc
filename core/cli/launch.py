"""Start an engine through the launcher: ``weightcache launch [--socket-dir DIR] [--strict] -- PYTHON-ARGS...``.

This process stands for the engine: it hands the launcher its standard streams and every fd it inherited, its
environment as it was exec'd, its working directory, umask, signal state and limits; it forwards SIGINT, SIGTERM,
SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH and SIGALRM to the engine and exits with the engine's status (or dies of
the same signal). Where no launcher answers, or the launcher refuses, it says why on one line and execs
``python PYTHON-ARGS`` itself: the engine starts all the same, at an exec's speed (``--strict``: status 1 instead).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import resource
import select
import signal
import socket
import sys
import typing

from weightcache.core.errors import LaunchRefused, WeightCacheError
from weightcache.core.socket_dir import SocketDir, SocketDirLike
from weightcache.core.wire.launch_request import LaunchRequest, initial_environment, launcher_socket
from weightcache.core.wire.paths import check_client_dir, check_server_peer
from weightcache.core.wire.protocol import FrameReader, close_fds, send_frame

FORWARDED = (
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH,
    signal.SIGALRM,
)  # fmt: skip
CORE_DUMPING = (signal.SIGQUIT, signal.SIGILL, signal.SIGABRT, signal.SIGFPE, signal.SIGSEGV, signal.SIGBUS, signal.SIGSYS)
CONNECT_TIMEOUT_S = 10.0


class Launched:
    """An engine the launcher started for this process: its ``pid``; ``send_signal``; ``wait`` for its status."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn = conn
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)  # the launcher keeps the engine unreaped until we close: never a recycled pid
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def wait(self) -> int | None:
        """The engine's status (negative: the signal it died of); None if the launcher went away first (then this waits
        for the engine to exit, whose status nobody but its parent can read)."""
        if self.returncode is not None:
            return self.returncode
        self.conn.settimeout(None)
        try:
            frame = FrameReader(self.conn).read(idle_timeout=None)
        except (OSError, WeightCacheError):
            frame = None
        if frame is not None and "returncode" in frame[0]:
            close_fds(frame[1])
            self.returncode = int(frame[0]["returncode"])
            return self.returncode
        select.select([self.pidfd], [], [])
        return None

    def close(self) -> None:
        self.conn.close()
        os.close(self.pidfd)


def inherited_fds() -> list[int]:
    """The fds an exec would pass on: 0, 1 and 2, and every other open fd without close-on-exec."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            continue  # the listing's own fd, closed by now
        if fd <= 2 or not flags & fcntl.FD_CLOEXEC:
            found.append(fd)
    return sorted(found)


def connect(socket_dir: SocketDirLike, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection to the launcher in ``socket_dir``, after the client's checks of the directory and of the peer
    (FileNotFoundError or ConnectionRefusedError where none listens)."""
    directory = SocketDir.parse(socket_dir)
    check_client_dir(directory.path)
    path = launcher_socket(directory)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        check_server_peer(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


def ask(socket_dir: SocketDirLike, message: dict, timeout: float = CONNECT_TIMEOUT_S) -> dict:
    """One request to the launcher in ``socket_dir`` (``{"op": "hello"}``: its pid, engines, the child forked ahead,
    ``ahead_ready``); its reply, or ``{}`` when it closed without one."""
    sock = connect(socket_dir, timeout)
    try:
        send_frame(sock, message)
        reply = FrameReader(sock).read(idle_timeout=timeout)
    finally:
        sock.close()
    return reply[0] if reply is not None else {}


def start(
    argv: typing.Sequence[str],
    socket_dir: SocketDirLike = None,
    env: dict[str, str] | None = None,
    fds: typing.Sequence[int] | None = None,
    timeout: float = CONNECT_TIMEOUT_S,
) -> Launched:
    """Ask the launcher to start ``python ARGV`` with this process's state. LaunchRefused says why it will not (no
    launcher, another user's, a refusal); the caller may then exec."""
    fds = inherited_fds() if fds is None else list(fds)
    request = LaunchRequest.of_this_process(argv, initial_environment() if env is None else env, fds)
    path = launcher_socket(SocketDir.parse(socket_dir))
    try:
        sock = connect(socket_dir, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise LaunchRefused("no_launcher", f"no launcher at {path} (start one: `weightcache launcher`)") from None
    except (OSError, WeightCacheError) as exc:
        raise LaunchRefused("no_launcher", f"the launcher at {path} cannot be used: {exc}") from None
    try:
        send_frame(sock, request.to_message(), fds)
        frame = FrameReader(sock, deadline_s=timeout).read(idle_timeout=timeout)
    except (OSError, WeightCacheError) as exc:
        sock.close()
        raise LaunchRefused("no_launcher", f"the launcher at {path} did not answer: {exc}") from None
    if frame is None:
        sock.close()
        raise LaunchRefused("no_launcher", f"the launcher at {path} closed the connection")
    message, received = frame
    close_fds(received)
    error = message.get("error")
    if error:
        sock.close()
        raise LaunchRefused(str(error.get("code", "refused")), str(error.get("message", error)))
    return Launched(sock, int(message["pid"]))


def exit_like(returncode: int) -> typing.NoReturn:
    """Exit with ``returncode``, or die of the signal a negative one names (no core file of this process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    if sig in CORE_DUMPING:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, blocked or reset
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def exec_python(argv: typing.Sequence[str], env: dict[str, str]) -> typing.NoReturn:
    """What the launcher would have spared: ``python ARGV`` in this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def launch(argv: typing.Sequence[str], socket_dir: SocketDirLike = None, strict: bool = False) -> typing.NoReturn:
    """Start ``python ARGV`` through the launcher and end this process as the engine ends; exec it where refused."""
    pending: list[int] = []
    launched: Launched | None = None

    def forward(sig: int, _frame: typing.Any) -> None:
        if launched is None:
            pending.append(sig)
        else:
            launched.send_signal(sig)

    # A signal the caller ignores stays ignored: not forwarded, and the request (made below) names it ignored, as an
    # exec'd engine would inherit it (`nohup`, a background job of a script).
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED if signal.getsignal(sig) is not signal.SIG_IGN}
    env = initial_environment()
    try:
        launched = start(argv, socket_dir, env=env)
    except LaunchRefused as exc:
        print(f"weightcache launch: {exc}", file=sys.stderr, flush=True)
        if strict:
            os._exit(1)
        for forwarded, handler in previous.items():
            signal.signal(forwarded, handler)
        exec_python(argv, env)
    for sig in pending:
        launched.send_signal(sig)
    code = launched.wait()
    if code is None:
        print(
            f"weightcache launch: the launcher went away while engine pid {launched.pid} ran; it has exited, and only "
            "its parent could read its status",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    launched.close()
    exit_like(code)


# --- the `weightcache launch` command (registered under the `weightcache.commands` entry points) ---------------------


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="start an engine through the launcher (`python ARGS` without the imports); exits with its status",
        description=__doc__.replace("``", "") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--socket-dir", help="the launcher's private directory (default: weightcache's default)")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 where the launcher refuses, no exec")
    parser.add_argument("python_args", nargs=argparse.REMAINDER, metavar="-- PYTHON-ARGS", help="what `python` would get")
    return parser


def run(args: argparse.Namespace) -> int:
    argv = list(args.python_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("weightcache launch: error: no command; give the arguments of `python` after `--`, e.g. "
              "`weightcache launch -- -m my_engine.serve --model M`", file=sys.stderr)  # fmt: skip
        return 2
    launch(argv, args.socket_dir, strict=args.strict)
