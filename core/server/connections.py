"""The server's open connections: which are idle, and which to shed when the table is full or fds run out.

A connection is *idle* when it has no attachment, no frame in progress or
being answered, and no bytes waiting to be read. Idle connections are
the only ones the server closes on its own (after ``idle_timeout_s``, or to
make room); an attached connection is an engine's attach session and stays
open for as long as the engine keeps it (docs/decisions.md #2).
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time

import attrs

from weightcache.core.wire.protocol import FrameReader

log = logging.getLogger(__name__)

OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept() or a request failing with one of these is never fatal: idle connections are shed and it is tried again."""
SHED_WHEN_OUT_OF_FDS = 4
"""Idle connections closed when fds run out: room for the newcomer and its replies."""


@attrs.define(eq=False)
class ConnectionState:
    """One accepted connection, as its serving thread and the accept loop see it."""

    id: int
    sock: socket.socket
    pid: int = 0
    reader: FrameReader | None = None
    attached: set = attrs.field(factory=set)  # digests attached over this connection
    last_active: float = attrs.field(factory=time.monotonic)
    closed: threading.Event = attrs.field(factory=threading.Event)  # set by its thread once the socket is closed

    def note_reply(self, message: dict, reply: dict) -> None:
        """Track attach and detach answered over this connection, and the time of its last request."""
        self.last_active = time.monotonic()
        if not reply.get("ok"):
            return
        if message.get("op") == "attach":
            self.attached.add(str(reply.get("digest")))
        elif message.get("op") == "detach":
            self.attached.discard(str(message.get("digest")))

    def is_idle(self) -> bool:
        if self.attached or (self.reader is not None and self.reader.busy):
            return False
        return not _has_input(self.sock)


def _has_input(sock: socket.socket) -> bool:
    """Whether bytes (or the end of the stream) wait to be read: a request may have just arrived."""
    fileno = sock.fileno()
    if fileno < 0:
        return True  # closed under us: certainly not idle and waiting
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    return bool(poller.poll(0))


class ConnectionTable:
    """The open connections, at most ``limit``; a newcomer over the limit displaces the longest-idle one."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open: dict[int, ConnectionState] = {}
        self._lock = threading.Lock()

    def admit(self, state: ConnectionState) -> bool:
        """Add ``state``; at the limit, first shed the longest-idle connection. False when none can be shed."""
        with self._lock:
            if len(self._open) >= self.limit and not self._shed_locked(1, "to make room for a new connection"):
                return False  # the shed one's thread closes it soon; the newcomer needs no fd of it
            self._open[state.id] = state
            return True

    def open_count(self) -> int:
        """Connections served now."""
        with self._lock:
            return len(self._open)

    def remove(self, state: ConnectionState) -> None:
        """Forget ``state`` (its thread does this before closing the socket, so the table never holds a closed one)."""
        with self._lock:
            self._open.pop(state.id, None)

    def shed_idle(self, count: int, why: str, wait_s: float = 1.0) -> int:
        """Close up to ``count`` idle connections, longest idle first, and wait (up to ``wait_s``) until their fds are free.

        Returns the number closed.
        """
        with self._lock:
            shed = self._shed_locked(count, why)
        deadline = time.monotonic() + wait_s
        for state in shed:
            state.closed.wait(max(0.0, deadline - time.monotonic()))
        return len(shed)

    def _shed_locked(self, count: int, why: str) -> list[ConnectionState]:
        idle = sorted((s for s in self._open.values() if s.is_idle()), key=lambda s: s.last_active)[:count]
        now = time.monotonic()
        for state in idle:
            log.info("closing pid %d's connection, idle for %.1f s, %s", state.pid, now - state.last_active, why)
            del self._open[state.id]
            _hang_up(state.sock)  # its thread reads the end of the stream, cleans up and closes the socket
        return idle

    def close_all(self) -> None:
        """Hang up every connection (the server is stopping)."""
        with self._lock:
            for state in self._open.values():
                _hang_up(state.sock)


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
