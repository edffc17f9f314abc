"""A launcher: engines start as forks of one process that has imported the frameworks already (``weightcache launcher``).

    weightcache launcher [--socket-dir DIR] [--preload MODULES] [--engines NAMES] [--model DIR ...] [--no-warm]
                         [--replace] [--cuda-ready DEVICE]
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
changed on disk, when the caller's interpreter or environment differs on what the preloaded code depends on (never on
the shell's, the terminal's or the service manager's own variables: a ``cd``, ``nice`` or script is forked), or when
a fork would not be safe. A malformed request gets one line back; each caller has its own deadline to send its request. ``--replace`` takes the socket over from a running launcher, which finishes its engines' waits and exits;
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

from weightcache.core import __version__
from weightcache.core.cli.cli_options import add_socket_dir, help_text
from weightcache.core.cli.launch import ask, connect
from weightcache.core.device import Device
from weightcache.core.errors import LauncherError, LaunchRefused, ProtocolError
from weightcache.core.socket_dir import SocketDir, SocketDirLike
from weightcache.core.spare.ahead import (
    CUDA_ENVIRONMENT,
    CUDA_FD_FLOOR,
    ForksAhead,
    Waiting,
    cuda_environment_differences,
    opened_above,
)
from weightcache.core.spare.connections import MAX_PENDING, REQUEST_DEADLINE_S, Pending
from weightcache.core.spare.engines import AHEAD_DELAY_S, Child, RunningEngine, try_send
from weightcache.core.spare.preload import Preloaded, nvml_based_cuda_check, prepare
from weightcache.core.wire.launch_request import LaunchRequest, Target, launcher_socket
from weightcache.core.wire.paths import ensure_private_dir, peer_credentials
from weightcache.core.wire.protocol import FrameReader, close_fds, error_reply, ok_reply, send_frame

__all__ = [  # the names this module had before the launcher was split, where callers import them
    "AHEAD_DELAY_S",
    "CUDA_ENVIRONMENT",
    "CUDA_FD_FLOOR",
    "REQUEST_DEADLINE_S",
    "Child",
    "Launcher",
    "add_parser",
    "cuda_environment_differences",
    "opened_above",
    "run",
]

log = logging.getLogger(__name__)


class Launcher(ForksAhead):
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
        engines: typing.Sequence[str] | None = None,
    ):
        self.socket_dir = SocketDir.parse(socket_dir)
        self.path = launcher_socket(self.socket_dir)
        self.preload = preload
        self.models = tuple(models)
        self.engines = tuple(engines) if engines is not None else None
        """The engines whose modules the default preload imports (None: every installed one an adapter names)."""
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
        self._engines: dict[int, RunningEngine] = {}
        self._waiting: Waiting | None = None
        self._ahead_at = 0.0
        """When to fork the next child ahead (``time.monotonic``)."""
        self._selector: selectors.BaseSelector | None = None
        self._wakeup: tuple[int, int] | None = None
        self._stopping = False
        self._pending: set[Pending] = set()
        """Connections whose request is still arriving."""

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
        self.preloaded = prepare(self.preload, self.models, warm=self.warm, engines=self.engines)
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
            listener.setblocking(False)  # every waiting connection is taken at once, none waited on
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
                ahead = wait if wait > 0 and self._waiting is None and self.fork_ahead else None
                for key, _ in selector.select(self._timeout(ahead)):
                    child = self._event(key)
                    if child is not None:
                        return child
                self._expire()
            return None
        finally:
            if os.getpid() == self.pid:
                self._close()

    def _event(self, key: selectors.SelectorKey) -> Child | None:
        """Handle what ``key`` says is ready; in a forked child, the Child to run."""
        kind, what = key.data
        if kind == "listener":
            self._accept()
        elif kind == "request":
            return self._arrived(what)
        elif kind == "waiting":
            self._waiting_exited()
        elif kind == "ready":
            self._waiting_ready(what)
        elif kind == "exit":
            self._exited(what)
        elif kind == "conn":
            self._caller_closed(what)
        elif kind == "stop":
            os.read(key.fd, 512)
            self._stopping = True
        return None

    def _timeout(self, ahead: float | None) -> float | None:
        """How long the next select may wait: until the next child is forked ahead or a request's deadline passes."""
        waits = [p.deadline - time.monotonic() for p in self._pending]
        if ahead is not None:
            waits.append(ahead)
        return max(0.0, min(waits)) if waits else None

    def _catch_stop_signals(self, selector: selectors.BaseSelector) -> None:
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup = (read_end, write_end)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the byte on the wake-up fd is what counts
        selector.register(read_end, selectors.EVENT_READ, ("stop", None))

    def _accept(self) -> None:
        """Take every connection that waits: one of another uid is refused at once; the others' requests are read as
        their bytes arrive (``_arrived``), each within its own deadline."""
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds: the oldest unfinished request makes room
                log.warning("cannot accept a connection: %s", exc)
                if not self._pending:
                    return
                self._drop(min(self._pending, key=lambda p: p.deadline), "dropped: the launcher is out of fds")
                continue
            try:
                pid, uid, _ = peer_credentials(conn)
            except OSError as exc:
                log.warning("dropped a connection whose peer cannot be told: %s", exc)
                conn.close()
                continue
            if uid != os.geteuid():
                log.warning("refused pid %d of uid %d: the launcher runs as uid %d", pid, uid, os.geteuid())
                try_send(conn, error_reply("access_denied", f"uid {uid} may not use a launcher of uid {os.geteuid()}"))
                conn.close()
                continue
            if len(self._pending) >= MAX_PENDING:
                self._drop(min(self._pending, key=lambda p: p.deadline), f"dropped: {MAX_PENDING} requests were arriving")
            pending = Pending.accepted(conn, pid)
            self._pending.add(pending)
            self._selector.register(conn, selectors.EVENT_READ, ("request", pending))

    def _arrived(self, pending: Pending) -> Child | None:
        """Read what came on ``pending``; once its request is whole, answer it (in a forked child: the Child to run)."""
        if pending not in self._pending:  # dropped by an earlier event of the same round
            return None
        try:
            frame = pending.read()
        except EOFError:
            self._drop(pending, None)
            return None
        except (OSError, ProtocolError) as exc:
            self._drop(pending, f"malformed request: {exc}")
            return None
        if frame is None:
            return None
        self._forget(pending)
        try:
            return self._answer(pending.conn, pending.pid, *frame)
        except (OSError, ProtocolError) as exc:
            log.warning("dropped a request from pid %d: %s", pending.pid, exc)
            pending.conn.close()
            return None

    def _forget(self, pending: Pending) -> None:
        assert self._selector is not None
        self._pending.discard(pending)
        self._selector.unregister(pending.conn)

    def _drop(self, pending: Pending, why: str | None) -> None:
        """Close ``pending``, telling its caller ``why`` on one line (None: it closed first)."""
        self._forget(pending)
        if why is not None:
            log.warning("request from pid %d %s", pending.pid, why)
            try_send(pending.conn, error_reply("bad_request", why))
        pending.close()

    def _expire(self) -> None:
        """Close the connections whose request did not arrive in time."""
        now = time.monotonic()
        for pending in [p for p in self._pending if p.deadline <= now]:
            self._drop(pending, f"dropped: no whole request within {REQUEST_DEADLINE_S:g} s of connecting")

    def _answer(self, conn: socket.socket, pid: int, message: dict, fds: list[int]) -> Child | None:
        """Answer a whole request (its fds are ``fds``); in a forked child, the Child to run."""
        op = message.get("op")
        if op != "launch":
            close_fds(fds)
            if op == "hello":
                reply = ok_reply(**self.hello())
            elif op == "retire":
                self._retire()
                reply = ok_reply(engines=len(self._engines))
            else:
                reply = error_reply("unknown_op", f"unknown request {str(op)[:40]!r}; run the same weightcache version")
            try_send(conn, reply)
            conn.close()
            return None
        try:
            request = LaunchRequest.from_message(message, len(fds))
            target = Target.parse(request.argv, request.cwd)
            if self.retired:
                raise LaunchRefused("retired", "this launcher was replaced and starts no more engines; ask again")
            assert self.preloaded is not None
            self.preloaded.check_request(request)
        except LaunchRefused as exc:
            close_fds(fds)
            log.info("refused a launch from pid %d: %s", pid, exc)
            try_send(conn, error_reply(exc.reason, str(exc)))
            conn.close()
            return None
        if self._waiting is not None and self._takes(request) and self._hand_over(conn, request, fds):
            return None
        return self._fork(conn, request, fds, target)

    def _release_in_child(self, keep: socket.socket) -> None:
        """Close the launcher's sockets, pidfds and pipes in a forked child (``keep``: the caller's connection)."""
        if self._selector is not None:
            self._selector.close()
        if self._listener is not None:
            self._listener.close()
        for pending in self._pending:
            pending.close()
        self._pending.clear()
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
        for pending in self._pending:
            pending.close()
        self._pending.clear()
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
        "--engines",
        metavar="NAMES",
        help="comma-separated engines whose modules the default preload imports, of the installed ones (vllm, sglang; "
        "default: all). A launched process carries everything the launcher imported, and its exit collects it: a "
        "launcher serving one engine kind preloads that one alone",
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
    engines = [e.strip() for e in args.engines.split(",") if e.strip()] if args.engines is not None else None
    launcher = Launcher(
        args.socket_dir,
        preload=preload,
        engines=engines,
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
