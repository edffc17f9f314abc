"""An engine's own ``spawn`` children, forked from the launcher's clean state instead of exec'd: vLLM's engine core and
workers, SGLang's scheduler and detokenizer start without importing the frameworks again.

A launched engine forks, before its target runs, one helper (the *nursery*) that keeps the launcher's state: one
thread, the frameworks imported, nothing of the engine's. multiprocessing's ``spawn`` method execs ``python -c
"...spawn_main(...)" --multiprocessing-fork`` through ``multiprocessing.util.spawnv_passfds``; in a launched engine
that function asks the nursery instead. The nursery checks the request as the launcher checks an engine's (the code
on disk, the environment names the imports read, fork safety), forks, and the fork forks the child and exits; the
engine has made itself a child subreaper for that moment, so the orphaned child becomes the engine's own: its parent
is the engine (``getppid``, ``PR_SET_PDEATHSIG``, ``psutil.Process().parent()``, ``waitpid``), as an exec'd child's
is. The child takes the engine's fds, environment, working directory, umask, signal state and limits at the call
(not its session: an exec'd child stays in the engine's), then runs the command line as ``python`` would. A refused
request, or a nursery that is gone, falls back to the exec.

The nursery ends when the engine is told to: a SIGTERM handler the engine sets (vLLM's engine core and workers,
SGLang's scheduler) first kills and reaps it, so an engine slow to exit after SIGTERM has no child of weightcache's
for its parent's process manager to find and force-kill (vLLM's ``kill_process_tree`` names each one it kills).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import typing

from weightcache.core.errors import LaunchRefused, WeightCacheError
from weightcache.core.spare.become import become, fresh_state, run_target
from weightcache.core.wire.launch_request import LaunchRequest, Target
from weightcache.core.wire.paths import peer_credentials
from weightcache.core.wire.protocol import FrameReader, close_fds, error_reply, send_frame

if typing.TYPE_CHECKING:
    from weightcache.core.spare.preload import Preloaded

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
REQUEST_DEADLINE_S = 30.0
ADOPTION_DEADLINE_S = 5.0


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def parent_death_signal(sig: int) -> None:
    """``PR_SET_PDEATHSIG``: this process gets ``sig`` when the thread that forked it ends (0: nothing)."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def _is_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return bool(flag.value)


class Nursery:
    """In a launched engine: the forked helper that starts the engine's ``spawn`` children (``open``, then
    ``install``)."""

    def __init__(self, address: str, pid: int):
        self.address = address
        self.pid = pid
        self.forked: list[int] = []
        """The children the nursery started."""
        self.refused: list[str] = []
        """Why the others were exec'd."""
        self._original: typing.Callable[..., int] | None = None
        self.closed = False

    @classmethod
    def open(cls, preloaded: Preloaded) -> Nursery:
        """Fork the nursery from this (still clean) process; it serves until this process ends. In a child the nursery
        forked, this never returns: the child runs its target from here and ends as ``python`` ends (through the
        frames above, as the engine's own target does)."""
        address = f"\0weightcache-nursery-{os.getpid()}-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(address)
        listener.listen(16)
        engine = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                target = _serve(listener, engine, preloaded)
            except BaseException:
                os._exit(1)
            if target is None:
                os._exit(0)
            cls.open(preloaded).install()  # the child's own spawn children (vLLM's workers) are forked too
            run_target(target, fresh_state(target, preloaded))
        listener.close()
        return cls(address, pid)

    def install(self) -> None:
        """Route multiprocessing's spawn exec through the nursery in this process, and end the nursery first in any
        SIGTERM handler this process sets."""
        self._original = multiprocessing.util.spawnv_passfds
        multiprocessing.util.spawnv_passfds = self.spawnv_passfds  # type: ignore[assignment]
        _TerminationHandlers.install(self.close)

    def close(self) -> None:
        """Kill and reap the nursery (once); spawn children after it are exec'd."""
        if self._original is not None:
            multiprocessing.util.spawnv_passfds = self._original
        if self.closed:
            return
        self.closed = True
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def spawnv_passfds(self, path: str, args: typing.Sequence[str], passfds: typing.Sequence[int]) -> int:
        """What ``multiprocessing.util.spawnv_passfds`` does (exec ``path ARGS`` with fds 0-2 and ``passfds``),
        forked from the nursery where it can be; returns the child's pid."""
        assert self._original is not None
        # spawn passes this interpreter's flags on (-B, -O, ...); a fork has them already, as the launcher's are this
        # process's, and the launcher refuses a caller whose PYTHON* variables differ
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        argv = [os.fsdecode(a) for a in args[1:]]
        if argv[: len(flags)] == flags:
            argv = argv[len(flags) :]
        if os.path.realpath(os.fsdecode(path)) == os.path.realpath(sys.executable):
            try:
                pid = self.start(argv, sorted({0, 1, 2, *passfds}))
            except LaunchRefused as exc:
                log.info("child exec'd, not forked from the nursery: %s", exc)
                self.refused.append(str(exc))
            else:
                self.forked.append(pid)
                return pid
        else:
            self.refused.append(f"{os.fsdecode(path)} is not this interpreter")
        return self._original(path, args, passfds)

    def start(self, argv: list[str], fds: list[int]) -> int:
        """Ask the nursery for ``python ARGV`` with this process's state and ``fds``; its pid. LaunchRefused says why
        it will not."""
        request = LaunchRequest.of_this_process(argv, dict(os.environ), fds)
        was_subreaper = _is_subreaper()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(REQUEST_DEADLINE_S)
        try:
            sock.connect(self.address)
            if not was_subreaper:
                _prctl(_PR_SET_CHILD_SUBREAPER, 1)
            try:
                send_frame(sock, request.to_message(), fds)
                frame = FrameReader(sock, deadline_s=REQUEST_DEADLINE_S).read(idle_timeout=REQUEST_DEADLINE_S)
            finally:
                if not was_subreaper:
                    _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        except (OSError, WeightCacheError) as exc:
            raise LaunchRefused("no_launcher", f"the nursery (pid {self.pid}) did not answer: {exc}") from None
        finally:
            sock.close()
        if frame is None:
            raise LaunchRefused("no_launcher", f"the nursery (pid {self.pid}) closed the connection")
        message, received = frame
        close_fds(received)
        error = message.get("error")
        if error:
            raise LaunchRefused(str(error.get("code", "refused")), str(error.get("message", error)))
        return int(message["pid"])


class _TerminationHandlers:
    """A SIGTERM handler a launched engine set, which runs ``first`` (ending the nursery) before itself. ``install``
    wraps ``signal.signal`` so; ``signal.getsignal`` gives the handler as it was set."""

    def __init__(self, handler: typing.Callable[..., typing.Any], first: typing.Callable[[], None]):
        self.handler = handler
        self.first = first

    def __call__(self, signum: int, frame: typing.Any) -> typing.Any:
        self.first()
        return self.handler(signum, frame)

    @staticmethod
    def install(first: typing.Callable[[], None]) -> None:
        set_handler = getattr(signal.signal, "weightcache_original", signal.signal)
        get_handler = getattr(signal.getsignal, "weightcache_original", signal.getsignal)

        def setting(signalnum: int, handler: typing.Any) -> typing.Any:
            if signalnum == signal.SIGTERM and callable(handler) and not isinstance(handler, _TerminationHandlers):
                handler = _TerminationHandlers(handler, first)
            return _unwrapped(set_handler(signalnum, handler))

        def getting(signalnum: int) -> typing.Any:
            return _unwrapped(get_handler(signalnum))

        setting.weightcache_original = set_handler  # type: ignore[attr-defined]
        getting.weightcache_original = get_handler  # type: ignore[attr-defined]
        signal.signal = setting
        signal.getsignal = getting


def _unwrapped(handler: typing.Any) -> typing.Any:
    return handler.handler if isinstance(handler, _TerminationHandlers) else handler


def _serve(listener: socket.socket, engine: int, preloaded: Preloaded) -> Target | None:
    """The nursery: dies with the engine, holds no fd of it, answers the engine's requests one at a time. Returns
    only in a child it forked (the target to run, its state taken already), or when the engine is gone (None)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != engine:
        return None
    keep = listener.fileno()
    os.closerange(0, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    devnull = os.open(os.devnull, os.O_RDWR)  # a failing nursery's Python must not write into the engine's streams
    for fd in (0, 1, 2):
        if fd != devnull:
            os.dup2(devnull, fd)
    if devnull > 2:
        os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process group gets the terminal's ^C; the nursery stays
    while True:
        conn, _ = listener.accept()
        try:
            target = _answer(conn, listener, engine, preloaded)
        except (OSError, WeightCacheError):
            target = None
        finally:
            conn.close()
        if target is not None:
            return target


def _answer(conn: socket.socket, listener: socket.socket, engine: int, preloaded: Preloaded) -> Target | None:
    """One request; the target in the child it forked, None in the nursery."""
    pid, _, _ = peer_credentials(conn)
    if pid != engine:
        send_frame(conn, error_reply("access_denied", f"pid {pid} is not the engine (pid {engine}) of this nursery"))
        return None
    conn.settimeout(REQUEST_DEADLINE_S)
    frame = FrameReader(conn, deadline_s=REQUEST_DEADLINE_S).read(idle_timeout=REQUEST_DEADLINE_S)
    if frame is None:
        return None
    message, fds = frame
    try:
        request = LaunchRequest.from_message(message, len(fds))
        target = Target.parse(request.argv, request.cwd)
        preloaded.check_request(request)
    except LaunchRefused as exc:
        close_fds(fds)
        send_frame(conn, error_reply(exc.reason, str(exc)))
        return None
    between = os.fork()
    if between == 0:  # forks the child and exits: the child, orphaned, goes to the engine (a subreaper now)
        try:
            child = os.fork()
        except BaseException:
            os._exit(1)
        if child != 0:
            os._exit(0)
        listener.close()
        _adopted(request, fds, conn, engine)
        return target
    close_fds(fds)
    os.waitpid(between, 0)
    return None


def _adopted(request: LaunchRequest, fds: list[int], conn: socket.socket, engine: int) -> None:
    """In the child: wait to be the engine's, then take the request's state and tell the engine its pid."""
    deadline = time.monotonic() + ADOPTION_DEADLINE_S
    while os.getppid() != engine:
        if time.monotonic() > deadline:
            send_frame(conn, error_reply("start_failed", f"the child was not adopted by the engine (pid {engine})"))
            os._exit(255)
        time.sleep(0.001)
    become(request, fds, conn, session=False)
