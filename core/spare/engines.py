"""A launcher's engines: forked for a request (each takes the caller's state in ``become``), reported to their caller
when they exit, reaped once the caller has read the status, killed when the caller goes away first.
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

from weightcache.core.spare.become import become, fresh_state, run_target
from weightcache.core.spare.children import Nursery
from weightcache.core.wire.launch_request import LaunchRequest, Target
from weightcache.core.wire.protocol import close_fds, ok_reply, send_frame

if typing.TYPE_CHECKING:
    from weightcache.core.spare.preload import Preloaded

log = logging.getLogger(__name__)

AHEAD_DELAY_S = 1.0
"""After starting an engine, how long the launcher waits before it forks the next child ahead: the engine that starts
has the cores meanwhile."""


@attrs.define
class RunningEngine:
    """An engine this launcher forked: the caller's connection (None once it closed) and the engine's pidfd."""

    conn: socket.socket | None
    pidfd: int
    returncode: int | None = None


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


class Engines:
    """The launcher's engines (a mixin of ``Launcher``): ``_engines`` by pid, each watched on the launcher's selector."""

    pid: int
    nursery: bool
    preloaded: Preloaded | None
    _engines: dict[int, RunningEngine]
    _selector: selectors.BaseSelector | None
    _ahead_at: float

    def _release_in_child(self, keep: socket.socket) -> None:
        raise NotImplementedError

    def _fork(self, conn: socket.socket, request: LaunchRequest, fds: list[int], target: Target) -> Child | None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        child = os.fork()
        if child == 0:
            return self._in_child(conn, request, fds, target)
        close_fds(fds)
        self._ahead_at = time.monotonic() + AHEAD_DELAY_S
        pidfd = os.pidfd_open(child)
        self._engines[child] = RunningEngine(conn, pidfd)
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
            try_send(engine.conn, ok_reply(returncode=code))  # the caller closes; the zombie stays until then
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


def try_send(conn: socket.socket, message: dict) -> None:
    try:
        conn.settimeout(1.0)
        send_frame(conn, message)
    except OSError:
        pass
