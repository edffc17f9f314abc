"""A launcher: engines start as forks of one process that has imported the frameworks already (``weightcache launcher``).

    weightcache launcher [--socket-dir DIR] [--preload MODULES] [--model DIR ...] [--no-warm] [--replace]
                         [--cuda-ready DEVICE]
    weightcache launch [--socket-dir DIR] [--strict] -- PYTHON-ARGS...

The launcher imports torch, transformers, tokenizers, weightcache's load route and the installed adapters (and vLLM or
SGLang where an installed adapter names them) once,
creates no CUDA context and no thread pool, warms torch's CPU kernels on one thread, and listens on ``launcher.sock``
in the server's private directory (0700; peers of another uid are refused by their credentials). ``weightcache
launch -- -m my_engine.serve --model M`` asks it for an engine: the launcher forks, and the child takes the caller's
fds, environment, working directory, umask, signal state and limits, then runs the module, code or script as
``python`` would. ``launch`` forwards signals to the engine and exits with its status. The fork is made ahead: one
child waits for the next request, its nursery forked and the request-free part of its fresh state done, and dies with
the launcher until a request comes; the next is forked a second after an engine started. With ``--cuda-ready DEVICE``
that child also makes its CUDA context on the device and warms its kernels while it waits (the launcher itself never
does), and takes only a request whose CUDA environment (``CUDA_*``, ``NVIDIA_*``, cuBLAS, cuDNN, NCCL) is the launcher's;
another is forked without one.

A launcher refuses (and ``launch`` execs the engine itself, with one line saying why) when its imported code
changed on disk, when the caller's environment differs on a name the imports read, or when a fork would not be
safe. ``--replace`` takes the socket over from a running launcher, which finishes its engines' waits and exits;
engines are independent processes, so neither replacing nor killing a launcher stops them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import typing

import attrs

from weightcache.core import __version__
from weightcache.core.cli.cli_options import add_socket_dir, help_text
from weightcache.core.cli.launch import ask, connect
from weightcache.core.device import Device
from weightcache.core.errors import LauncherError, LaunchRefused, ProtocolError
from weightcache.core.socket_dir import SocketDir, SocketDirLike
from weightcache.core.spare.become import become, fresh_state, run_target, settle
from weightcache.core.spare.children import Nursery, parent_death_signal
from weightcache.core.spare.preload import Preloaded, nvml_based_cuda_check, prepare
from weightcache.core.spare.warm import prepare_cuda
from weightcache.core.wire.launch_request import LaunchRequest, Target, launcher_socket
from weightcache.core.wire.paths import ensure_private_dir, peer_credentials
from weightcache.core.wire.protocol import FrameReader, close_fds, error_reply, ok_reply, send_frame

log = logging.getLogger(__name__)

REQUEST_DEADLINE_S = 10.0
AHEAD_DELAY_S = 1.0
"""After starting an engine, how long the launcher waits before it forks the next child ahead: the engine that starts
has the cores meanwhile."""
CUDA_ENVIRONMENT = ("CUDA_", "NVIDIA_", "CUBLAS", "CUDNN", "NCCL_")
"""Environment names (prefixes) a CUDA context is made under: a child forked ahead with ``--cuda-ready`` takes only a
request that agrees with the launcher on all of them (torch's own ``PYTORCH_``/``TORCH`` names must agree for any fork)."""
_READY = b"R"
"""What a child forked ahead writes to its channel once it waits for a request (its CUDA context made, if asked)."""
_CUDA_READY_FAILED = 75
"""A child forked ahead exits with this when it cannot make the CUDA context ``--cuda-ready`` asks for."""
CUDA_FD_FLOOR = 256
"""The fds a ``--cuda-ready`` child's CUDA context opens are numbered from here up (``opened_above``), and stay open
through ``become``; a request that gives its engine an fd numbered here or above is forked without a context."""


def cuda_environment_differences(launcher_env: typing.Mapping[str, str], caller_env: typing.Mapping[str, str]) -> list[str]:
    """The names of ``CUDA_ENVIRONMENT`` on which the caller's environment differs from the launcher's, sorted."""
    names = {n for n in launcher_env.keys() | caller_env.keys() if n.startswith(CUDA_ENVIRONMENT)}
    return sorted(n for n in names if launcher_env.get(n) != caller_env.get(n))


def opened_above(floor: int, make: typing.Callable[[], object]) -> frozenset[int]:
    """Run ``make`` with every free fd below ``floor`` taken meanwhile, so that what it opens is numbered ``floor`` or
    above (none can be one of a caller's low numbers); the fds it opened and left open. OSError (EMFILE) when the
    open-file limit is below ``floor``."""

    def listed() -> set[int]:
        return {int(fd) for fd in os.listdir("/proc/self/fd")}

    before = listed()
    taken = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # the lowest free number
            if fd >= floor:
                os.close(fd)
                break
            taken.append(fd)
        make()
    finally:
        for fd in taken:
            os.close(fd)
    return frozenset(fd for fd in listed() - before if fd >= floor)


@attrs.define
class _Engine:
    """An engine this launcher forked: the caller's connection (None once it closed) and the engine's pidfd."""

    conn: socket.socket | None
    pidfd: int
    returncode: int | None = None


@attrs.define
class _Waiting:
    """A child forked ahead of the next request (with its nursery forked already): it waits on ``channel``."""

    pid: int
    pidfd: int
    channel: socket.socket
    ready: bool = False
    """It wrote ``_READY``: it waits for a request (with its CUDA context, under ``--cuda-ready``)."""


@attrs.define
class Child:
    """What ``serve`` returns in a forked child: run it (never returns)."""

    target: Target
    preloaded: Preloaded
    nursery: bool = True
    """Whether the engine's ``spawn`` children are forked from a nursery (core/spare/children.py), not exec'd."""
    opened: Nursery | None = None
    """The nursery, where the child was forked ahead of its request and forked it while it waited."""

    def run(self) -> typing.NoReturn:
        if self.opened is not None:
            self.opened.install()
        elif self.nursery:
            Nursery.open(self.preloaded).install()
        run_target(self.target, fresh_state(self.target, self.preloaded))


class Launcher:
    """Serves engine starts on ``launcher.sock`` in ``socket_dir``: ``start()``, then ``serve()``."""

    def __init__(
        self,
        socket_dir: SocketDirLike = None,
        preload: typing.Sequence[str] | None = None,
        models: typing.Sequence[str] = (),
        warm: bool = True,
        replace: bool = False,
        nursery: bool = True,
        fork_ahead: bool = True,
        cuda_ready: str | None = None,
    ):
        self.socket_dir = SocketDir.parse(socket_dir)
        self.path = launcher_socket(self.socket_dir)
        self.preload = preload
        self.models = tuple(models)
        self.warm = warm
        self.replace = replace
        self.nursery = nursery
        self.fork_ahead = fork_ahead
        self.cuda_ready = Device.parse(cuda_ready) if cuda_ready else None
        """The device on which the child forked ahead makes its CUDA context before its request (None: it makes none)."""
        if self.cuda_ready is not None and not self.cuda_ready.is_cuda:
            raise LauncherError(f"--cuda-ready takes a CUDA device such as cuda:0, not {cuda_ready!r}")
        self.pid = os.getpid()
        self.preloaded: Preloaded | None = None
        self.retired = False
        self._listener: socket.socket | None = None
        self._engines: dict[int, _Engine] = {}
        self._waiting: _Waiting | None = None
        self._ahead_at = 0.0
        """When to fork the next child ahead (``time.monotonic``)."""
        self._selector: selectors.BaseSelector | None = None
        self._wakeup: tuple[int, int] | None = None
        self._stopping = False

    def start(self) -> dict:
        """``prepare()``, then ``listen()``; returns the ``ready`` report."""
        began = time.perf_counter()
        preloaded = self.prepare()
        self._check_cuda_ready()
        self.listen()
        return {
            "event": "ready",
            "pid": self.pid,
            "socket": self.path,
            "preloaded": list(preloaded.modules),
            "models": list(self.models),
            "cuda_ready": str(self.cuda_ready) if self.cuda_ready is not None else None,
            "timings": {**preloaded.timings, "ready_s": time.perf_counter() - began},
        }

    def prepare(self) -> Preloaded:
        """Import and check (``preload.prepare``): LauncherError says what is not fork-safe."""
        self.preloaded = prepare(self.preload, self.models, warm=self.warm)
        return self.preloaded

    def _check_cuda_ready(self) -> None:
        """LauncherError unless torch sees ``--cuda-ready``'s device, asked through NVML (no CUDA call in the launcher)."""
        if self.cuda_ready is None:
            return
        torch = sys.modules.get("torch")
        if torch is None:
            raise LauncherError("--cuda-ready needs torch among the preloads (it makes the CUDA context with torch)")
        with nvml_based_cuda_check():
            count = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
        if count < (self.cuda_ready.index or 0) + 1:  # a UUID (no index) needs one device; the driver finds it later
            raise LauncherError(
                f"--cuda-ready {self.cuda_ready}: torch here sees {count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); name a device it sees, or leave "
                "the option out on a machine without a GPU"
            )

    def listen(self) -> None:
        """Take the socket (from a running launcher only with ``replace``; it retires)."""
        ensure_private_dir(self.socket_dir.path)
        self._listen(self._predecessor())

    def _predecessor(self) -> bool:
        """Whether a launcher already answers on the socket (refused without ``replace``)."""
        if not os.path.exists(self.path):
            return False
        try:
            pid = self._ask({"op": "hello"}).get("pid")
        except (ConnectionRefusedError, FileNotFoundError):
            return False  # a launcher that died left its socket: taken over below
        if not self.replace:
            raise LauncherError(
                f"a launcher already serves at {self.path} (pid {pid}); `weightcache launcher --replace` takes its place "
                "(its running engines keep running)"
            )
        return True

    def _ask(self, message: dict) -> dict:
        """One request to the launcher on the socket, its reply."""
        return ask(self.socket_dir, message, REQUEST_DEADLINE_S)

    def _listen(self, predecessor: bool) -> None:
        staging = f"{self.path}.{self.pid}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        retire = None
        try:
            if predecessor:  # connected before the socket's path changes hands
                retire = connect(self.socket_dir, timeout=REQUEST_DEADLINE_S)
            if os.path.lexists(staging):
                os.unlink(staging)
            listener.bind(staging)
            os.chmod(staging, 0o600)
            listener.listen(64)
            os.replace(staging, self.path)  # one step: a caller reaches either launcher, never none
        except OSError:
            listener.close()
            if retire is not None:
                retire.close()
            raise
        self._listener = listener
        if retire is not None:
            try:
                send_frame(retire, {"op": "retire"})
                FrameReader(retire).read(idle_timeout=REQUEST_DEADLINE_S)
            except (OSError, ProtocolError) as exc:
                log.warning("the launcher this one replaces did not confirm it retired: %s", exc)
            finally:
                retire.close()

    def serve(self) -> Child | None:
        """Answer requests until stopped (SIGTERM, SIGINT) or retired with no engine left: None. In a forked child:
        the Child to run."""
        if self._listener is None or self.preloaded is None:
            raise LauncherError("start() the launcher before serving")
        selector = self._selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, ("listener", None))
        self._catch_stop_signals(selector)
        log.info("launcher (pid %d) serving on %s", self.pid, self.path)
        try:
            while not self._stopping and not (self.retired and not self._engines):
                wait = self._ahead_at - time.monotonic()
                if wait <= 0:
                    child = self._fork_waiting()
                    if child is not None:
                        return child
                for key, _ in selector.select(wait if wait > 0 and self._waiting is None and self.fork_ahead else None):
                    kind, pid = key.data
                    if kind == "listener":
                        child = self._accept()
                        if child is not None:
                            return child
                    elif kind == "waiting":
                        self._waiting_exited()
                    elif kind == "ready":
                        self._waiting_ready(pid)
                    elif kind == "exit":
                        self._exited(pid)
                    elif kind == "conn":
                        self._caller_closed(pid)
                    elif kind == "stop":
                        os.read(key.fd, 512)
                        self._stopping = True
            return None
        finally:
            if os.getpid() == self.pid:
                self._close()

    def _catch_stop_signals(self, selector: selectors.BaseSelector) -> None:
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup = (read_end, write_end)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the byte on the wake-up fd is what counts
        selector.register(read_end, selectors.EVENT_READ, ("stop", None))

    def _accept(self) -> Child | None:
        assert self._listener is not None
        conn, _ = self._listener.accept()
        conn.setblocking(True)
        try:
            return self._answer(conn)
        except (OSError, ProtocolError, TimeoutError) as exc:
            log.warning("dropped a request: %s", exc)
            conn.close()
            return None

    def _answer(self, conn: socket.socket) -> Child | None:
        pid, uid, _ = peer_credentials(conn)
        if uid != os.geteuid():
            log.warning("refused pid %d of uid %d: the launcher runs as uid %d", pid, uid, os.geteuid())
            _try_send(conn, error_reply("access_denied", f"uid {uid} may not use a launcher of uid {os.geteuid()}"))
            conn.close()
            return None
        frame = FrameReader(conn, deadline_s=REQUEST_DEADLINE_S).read(idle_timeout=REQUEST_DEADLINE_S)
        if frame is None:
            conn.close()
            return None
        message, fds = frame
        op = message.get("op")
        if op == "hello":
            close_fds(fds)
            send_frame(conn, ok_reply(**self.hello()))
            conn.close()
            return None
        if op == "retire":
            close_fds(fds)
            self._retire()
            send_frame(conn, ok_reply(engines=len(self._engines)))
            conn.close()
            return None
        if op != "launch":
            close_fds(fds)
            _try_send(conn, error_reply("unknown_op", f"unknown request {op!r}; run the same weightcache version"))
            conn.close()
            return None
        try:
            request = LaunchRequest.from_message(message, len(fds))
            target = Target.parse(request.argv)
            if self.retired:
                raise LaunchRefused("retired", "this launcher was replaced and starts no more engines; ask again")
            assert self.preloaded is not None
            self.preloaded.check_request(request.env, request.executable)
        except LaunchRefused as exc:
            close_fds(fds)
            log.info("refused a launch from pid %d: %s", pid, exc)
            _try_send(conn, error_reply(exc.reason, str(exc)))
            conn.close()
            return None
        if self._waiting is not None and self._takes(request) and self._hand_over(conn, request, fds):
            return None
        return self._fork(conn, request, fds, target)

    def _fork_waiting(self) -> Child | None:
        """Fork the child that takes the next request (it forks its nursery meanwhile), unless one waits already. In
        that child, once it has a request: the Child to run."""
        if not self.fork_ahead or self._waiting is not None or self.retired or self._stopping:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            return self._wait_for_request(theirs)
        theirs.close()
        self._waiting = _Waiting(pid, os.pidfd_open(pid), ours)
        assert self._selector is not None
        self._selector.register(self._waiting.pidfd, selectors.EVENT_READ, ("waiting", pid))
        self._selector.register(ours, selectors.EVENT_READ, ("ready", pid))
        return None

    def _wait_for_request(self, channel: socket.socket) -> Child:
        """In the child forked ahead: leave the launcher's session and fds, die with the launcher until a request comes, fork the
        nursery, then take the request the launcher hands over (with the caller's connection) as a fork would."""
        self._release_in_child(channel)
        os.setsid()  # now, so that the nursery forked below is in the engine's session and process group
        parent_death_signal(signal.SIGKILL)
        if os.getppid() != self.pid:
            os._exit(0)
        assert self.preloaded is not None
        opened = Nursery.open(self.preloaded) if self.nursery else None
        settle(self.preloaded)
        keep: frozenset[int] = frozenset()
        if self.cuda_ready is not None:  # after the nursery's fork: the engine's spawn children start without CUDA
            device = self.cuda_ready
            try:
                keep = opened_above(CUDA_FD_FLOOR, lambda: prepare_cuda(device))
            except Exception as exc:
                print(f"weightcache launcher: cannot make a CUDA context on {device} ahead: {exc}", file=sys.stderr)
                os._exit(_CUDA_READY_FAILED)
        try:
            channel.sendall(_READY)
        except OSError:  # the launcher handed a request over and closed its end before this: the request is still there
            pass
        frame = FrameReader(channel).read(idle_timeout=None)
        if frame is None:
            os._exit(0)
        parent_death_signal(0)  # an engine outlives its launcher
        channel.close()
        message, fds = frame
        conn = socket.socket(fileno=fds[0])
        request = LaunchRequest.from_message(message, len(fds) - 1)
        become(request, fds[1:], conn, session=False, keep=keep)
        return Child(Target.parse(request.argv), self.preloaded, self.nursery, opened)

    def _takes(self, request: LaunchRequest) -> bool:
        """Whether the child forked ahead may take ``request``: under ``--cuda-ready``, only with the launcher's CUDA
        environment (its context was made under it)."""
        if self.cuda_ready is None:
            return True
        assert self.preloaded is not None
        differ = cuda_environment_differences(self.preloaded.env, request.env)
        if differ:
            log.info("the child forked ahead made its CUDA context under another %s: forking one without", ", ".join(differ[:3]))
        high = [fd for fd in request.fds if fd >= CUDA_FD_FLOOR]
        if high:
            log.info("the request gives its engine fd %d, where the CUDA context's are: forking one without", high[0])
        return not differ and not high

    def _waiting_ready(self, pid: int) -> None:
        """The child forked ahead wrote to its channel: it is ready (or it ended, and its pidfd says so next). Nothing
        when that child is gone already (handed a request or ended, in the same round of events)."""
        waiting = self._waiting
        if waiting is None or waiting.pid != pid:
            return
        assert self._selector is not None
        self._selector.unregister(waiting.channel)
        try:
            waiting.ready = waiting.channel.recv(1) == _READY
        except OSError:
            waiting.ready = False

    def _unregister_waiting(self, waiting: _Waiting) -> None:
        assert self._selector is not None
        self._selector.unregister(waiting.pidfd)
        if not waiting.ready:
            try:
                self._selector.unregister(waiting.channel)
            except (KeyError, ValueError):
                pass  # read already: it had ended

    def _hand_over(self, conn: socket.socket, request: LaunchRequest, fds: list[int]) -> bool:
        """Give the request and the caller's connection to the child forked ahead; False if it cannot take it (a fork
        will)."""
        waiting, self._waiting = self._waiting, None
        assert waiting is not None and self._selector is not None
        self._unregister_waiting(waiting)
        try:
            send_frame(waiting.channel, request.to_message(), [conn.fileno(), *fds])
        except OSError as exc:
            log.warning("the child forked ahead (pid %d) could not take a request, forking instead: %s", waiting.pid, exc)
            self._end_waiting(waiting)
            return False
        finally:
            waiting.channel.close()
        close_fds(fds)
        self._ahead_at = time.monotonic() + AHEAD_DELAY_S
        self._engines[waiting.pid] = _Engine(conn, waiting.pidfd)
        self._selector.register(waiting.pidfd, selectors.EVENT_READ, ("exit", waiting.pid))
        self._selector.register(conn, selectors.EVENT_READ, ("conn", waiting.pid))
        log.info("started engine pid %d (forked ahead): %s", waiting.pid, " ".join(request.argv)[:200])
        return True

    def _waiting_exited(self) -> None:
        """The child forked ahead ended without a request. It could not make its CUDA context: the next ones make none.
        Otherwise (its nursery failed, or it was killed): no more are forked ahead."""
        waiting, self._waiting = self._waiting, None
        assert waiting is not None and self._selector is not None
        self._unregister_waiting(waiting)
        _, status = os.waitpid(waiting.pid, 0)
        if os.waitstatus_to_exitcode(status) == _CUDA_READY_FAILED:
            log.warning("the child forked ahead could not make a CUDA context on %s; the next ones make none", self.cuda_ready)
            self.cuda_ready = None
            self._ahead_at = time.monotonic()
        else:
            log.warning("the child forked ahead of requests (pid %d) exited; engines are forked at each request", waiting.pid)
            self.fork_ahead = False
        self._end_waiting(waiting, reaped=True)

    @staticmethod
    def _end_waiting(waiting: _Waiting, reaped: bool = False) -> None:
        if not reaped:
            try:
                signal.pidfd_send_signal(waiting.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(waiting.pid, 0)
        os.close(waiting.pidfd)
        waiting.channel.close()

    def _fork(self, conn: socket.socket, request: LaunchRequest, fds: list[int], target: Target) -> Child | None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        child = os.fork()
        if child == 0:
            return self._in_child(conn, request, fds, target)
        close_fds(fds)
        self._ahead_at = time.monotonic() + AHEAD_DELAY_S
        pidfd = os.pidfd_open(child)
        self._engines[child] = _Engine(conn, pidfd)
        assert self._selector is not None
        self._selector.register(pidfd, selectors.EVENT_READ, ("exit", child))
        self._selector.register(conn, selectors.EVENT_READ, ("conn", child))
        log.info("started engine pid %d: %s", child, " ".join(request.argv)[:200])
        return None

    def _in_child(self, conn: socket.socket, request: LaunchRequest, fds: list[int], target: Target) -> Child:
        self._release_in_child(conn)
        become(request, fds, conn)
        assert self.preloaded is not None
        return Child(target, self.preloaded, self.nursery)

    def _release_in_child(self, keep: socket.socket) -> None:
        """Close the launcher's sockets, pidfds and pipes in a forked child (``keep``: the caller's connection)."""
        if self._selector is not None:
            self._selector.close()
        if self._listener is not None:
            self._listener.close()
        for engine in self._engines.values():
            if engine.conn is not None and engine.conn is not keep:
                engine.conn.close()
            os.close(engine.pidfd)
        self._engines.clear()
        if self._waiting is not None:
            os.close(self._waiting.pidfd)
            self._waiting.channel.close()
            self._waiting = None
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _exited(self, pid: int) -> None:
        engine = self._engines[pid]
        assert self._selector is not None
        self._selector.unregister(engine.pidfd)
        result = os.waitid(os.P_PIDFD, engine.pidfd, os.WEXITED | os.WNOWAIT)
        code = 0
        if result is not None:
            code = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
        engine.returncode = code
        log.info("engine pid %d exited with status %d", pid, code)
        if engine.conn is not None:
            _try_send(engine.conn, ok_reply(returncode=code))  # the caller closes; the zombie stays until then
        else:
            self._reap(pid)

    def _caller_closed(self, pid: int) -> None:
        """The caller's connection closed: after the status, reap; before it, the caller is gone, so is its engine."""
        engine = self._engines[pid]
        assert self._selector is not None and engine.conn is not None
        self._selector.unregister(engine.conn)
        engine.conn.close()
        engine.conn = None
        if engine.returncode is not None:
            self._reap(pid)
        else:
            log.warning("the caller of engine pid %d went away; the engine is killed with it", pid)
            signal.pidfd_send_signal(engine.pidfd, signal.SIGKILL)

    def _reap(self, pid: int) -> None:
        engine = self._engines.pop(pid)
        os.waitpid(pid, 0)
        os.close(engine.pidfd)

    def _retire(self) -> None:
        """Start no more engines; stop listening (the socket's path is the successor's now); exit after the last one."""
        self.retired = True
        if self._waiting is not None:
            assert self._selector is not None
            self._selector.unregister(self._waiting.pidfd)
            self._end_waiting(self._waiting)
            self._waiting = None
        if self._listener is not None:
            assert self._selector is not None
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
        log.info("launcher retired: %d engine(s) still running", len(self._engines))

    def hello(self) -> dict:
        assert self.preloaded is not None
        return {
            "pid": self.pid,
            "version": __version__,
            "executable": os.path.realpath(sys.executable),
            "preloaded": list(self.preloaded.modules),
            "engines": sorted(self._engines),
            "ahead": self._waiting.pid if self._waiting is not None else None,
            "ahead_ready": self._waiting is not None and self._waiting.ready,
            "cuda_ready": str(self.cuda_ready) if self.cuda_ready is not None else None,
            "retired": self.retired,
            "stale": self.preloaded.stamp.changed(),
        }

    def _close(self) -> None:
        """Stop listening: unlink the socket if it is still this launcher's. Engines keep running."""
        if self._listener is not None:
            try:
                if os.stat(self.path).st_ino == os.fstat(self._listener.fileno()).st_ino:
                    os.unlink(self.path)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if self._waiting is not None:
            self._end_waiting(self._waiting)
            self._waiting = None
        for engine in self._engines.values():
            if engine.conn is not None:
                engine.conn.close()
            os.close(engine.pidfd)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None


def _try_send(conn: socket.socket, message: dict) -> None:
    try:
        conn.settimeout(1.0)
        send_frame(conn, message)
    except OSError:
        pass


# --- the `weightcache launcher` command (registered under the `weightcache.commands` entry points) ------------------


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launcher",
        help="pre-import the frameworks once; start engines as forks (`weightcache launch`)",
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_socket_dir(parser)
    parser.add_argument(
        "--preload",
        metavar="MODULES",
        help="comma-separated modules to import (default: numpy, torch, safetensors, tokenizers, transformers, "
        "weightcache's load route, the installed adapters and the installed engines they name)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="DIR",
        help="also import this checkpoint's model module (repeatable)",
    )
    parser.add_argument("--no-warm", action="store_true", help="do not run torch's CPU kernels once before serving")
    parser.add_argument("--replace", action="store_true", help="take the socket over from a running launcher")
    parser.add_argument(
        "--exec-children",
        action="store_true",
        help="engines exec their multiprocessing spawn children (vLLM's engine core, SGLang's scheduler) as `python` "
        "would, instead of forking them from a nursery of the launcher's state",
    )
    parser.add_argument(
        "--cuda-ready",
        metavar="DEVICE",
        help="the child forked ahead of the next request makes its CUDA context on DEVICE (e.g. cuda:0) and warms its "
        "kernels while it waits; it takes only requests with the launcher's CUDA_* environment. Its engine starts with "
        "CUDA initialised, so one that picks its GPU itself (setting CUDA_VISIBLE_DEVICES after it starts) must not use it",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    preload = [m.strip() for m in args.preload.split(",") if m.strip()] if args.preload is not None else None
    launcher = Launcher(
        args.socket_dir,
        preload=preload,
        models=args.model,
        warm=not args.no_warm,
        replace=args.replace,
        nursery=not args.exec_children,
        cuda_ready=args.cuda_ready,
    )
    print(json.dumps(launcher.start()), flush=True)
    child = launcher.serve()
    if child is None:
        return 0
    child.run()
