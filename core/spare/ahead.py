"""The child a launcher forks ahead of the next request: it forks its nursery and settles its fresh state while it
waits, and (``--cuda-ready``) makes its CUDA context; a request it can take is handed to it with the caller's connection.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
import time
import typing

import attrs

from weightcache.core.spare.become import become, settle
from weightcache.core.spare.children import Nursery, parent_death_signal
from weightcache.core.spare.engines import AHEAD_DELAY_S, Child, Engines, RunningEngine
from weightcache.core.spare.warm import prepare_cuda
from weightcache.core.wire.launch_request import LaunchRequest, Target
from weightcache.core.wire.protocol import FrameReader, close_fds, send_frame

if typing.TYPE_CHECKING:
    from weightcache.core.device import Device

log = logging.getLogger(__name__)

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
class Waiting:
    """A child forked ahead of the next request (with its nursery forked already): it waits on ``channel``."""

    pid: int
    pidfd: int
    channel: socket.socket
    ready: bool = False
    """It wrote ``_READY``: it waits for a request (with its CUDA context, under ``--cuda-ready``)."""


class ForksAhead(Engines):
    """The launcher's part that keeps one child forked ahead of the next request (a mixin of ``Launcher``)."""

    fork_ahead: bool
    cuda_ready: Device | None
    retired: bool
    _stopping: bool
    _waiting: Waiting | None
    _ahead_at: float

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
        self._waiting = Waiting(pid, os.pidfd_open(pid), ours)
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
        return Child(Target.parse(request.argv, request.cwd), self.preloaded, self.nursery, opened)

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

    def _unregister_waiting(self, waiting: Waiting) -> None:
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
        self._engines[waiting.pid] = RunningEngine(conn, waiting.pidfd)
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
    def _end_waiting(waiting: Waiting, reaped: bool = False) -> None:
        if not reaped:
            try:
                signal.pidfd_send_signal(waiting.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(waiting.pid, 0)
        os.close(waiting.pidfd)
        waiting.channel.close()
