"""The server's connections, one thread each: who may talk to it, the frames read and answered, and the handover.

A connection of another uid is refused; a frame that breaks a limit ends its connection with a reply that says
which; a ``handover`` request from a successor sends every entry, the listener and the lock over that connection
(``core/server/handover.py``), after which this server stops.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import typing

from weightcache.core.errors import IdleTimeout, ProtocolError
from weightcache.core.server import readiness
from weightcache.core.server.connections import ConnectionState, ConnectionTable
from weightcache.core.server.handover import HANDED, Listeners, send_entries
from weightcache.core.server.metrics import Metrics
from weightcache.core.server.registry import Registry
from weightcache.core.wire.paths import peer_credentials
from weightcache.core.wire.protocol import FrameReader, InFlight, close_fds, error_reply, ok_reply, send_frame

if typing.TYPE_CHECKING:
    from weightcache.core.server.server import ServerConfig

log = logging.getLogger(__name__)


class Sessions:
    """The per-connection part of ``Server`` (a mixin: the state it reads is the server's)."""

    config: ServerConfig
    metrics: Metrics
    registry: Registry
    _requester: threading.local
    _ids: typing.Iterator[int]
    _table: ConnectionTable
    _in_flight: InFlight
    _stopping: threading.Event
    _frozen: threading.Event
    _accepting: threading.Event
    _handed_over: bool
    _listener: socket.socket | None
    _metrics_listener: socket.socket | None
    _lock_fd: int

    stop: typing.Callable[[], None]
    _dispatch: typing.Callable[[dict, list[int], int, int], tuple[dict, list[int]]]  # Requests'

    def _spawn(self, conn: socket.socket) -> None:
        state = ConnectionState(next(self._ids), conn)
        self.metrics.connected()
        if not self._table.admit(state):
            log.warning("refusing a connection: %d connections open and none idle", self._table.limit)
            self._refuse(conn, "busy", "too many connections, none of them idle; try again shortly")
            conn.close()
            return
        try:
            threading.Thread(target=self._serve_connection, args=(state,), daemon=True).start()
        except RuntimeError as exc:  # no more threads
            self._table.remove(state)
            log.warning("refusing a connection: %s", exc)
            self._refuse(conn, "busy", "the server cannot start another thread; try again shortly")
            conn.close()

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        """Tell the peer why it is refused (the caller closes the connection)."""
        self.metrics.refused(code)
        try:
            conn.settimeout(1.0)
            send_frame(conn, error_reply(code, message))
        except OSError:
            pass

    def _serve_connection(self, state: ConnectionState) -> None:
        conn = state.sock
        try:
            pid, uid, _ = peer_credentials(conn)
            state.pid = self._requester.pid = pid
            if uid != os.geteuid():
                log.warning(
                    "refused pid %d of uid %d: the server runs as uid %d", pid, uid, os.geteuid(), extra={"peer_pid": pid}
                )
                self._refuse(
                    conn,
                    "access_denied",
                    f"uid {uid} may not use a server of uid {os.geteuid()}; run the engine as the server's user",
                )
                return
            state.reader = reader = FrameReader(conn, self.config.max_frame_bytes, self.config.frame_deadline_s, self._in_flight)
            while not self._stopping.is_set():
                idle_timeout = None if state.attached else self.config.idle_timeout_s
                try:
                    frame = reader.read(idle_timeout=idle_timeout)
                except IdleTimeout:
                    log.info(
                        "closing pid %d's connection: idle for %g s with nothing attached",
                        pid,
                        idle_timeout,
                        extra={"peer_pid": pid},
                    )
                    return
                except ProtocolError as exc:
                    log.warning(
                        "refused a frame from pid %d (%s): %s", pid, exc.code, exc, extra={"peer_pid": pid, "code": exc.code}
                    )
                    self.metrics.refused(exc.code)
                    self._try_send(conn, error_reply(exc.code, str(exc)))
                    return
                except (TimeoutError, OSError) as exc:
                    log.warning("dropping pid %d's connection: %s", pid, exc or type(exc).__name__, extra={"peer_pid": pid})
                    return
                if frame is None:
                    return
                message, fds = frame
                if message.get("op") == "handover":
                    close_fds(fds)
                    self._hand_over(conn, pid)
                    return
                started = time.perf_counter()
                reply, reply_fds = self._dispatch(message, fds, state.id, pid)
                self.metrics.answered(str(message.get("op")), reply, time.perf_counter() - started, pid)
                state.note_reply(message, reply)
                try:
                    if not self._try_send(conn, reply, reply_fds):
                        return
                finally:
                    close_fds(reply_fds)  # our own duplicates, made for this reply
        except Exception:
            log.exception("unexpected error serving connection %d", state.id)
        finally:
            self.registry.drop_connection(state.id)
            self._table.remove(state)
            conn.close()
            state.closed.set()

    def _hand_over(self, conn: socket.socket, pid: int) -> None:
        """Send every entry, the listener and the lock to the successor pid ``pid``; stop once it confirmed
        . Until then entries stay unchanged here and this server keeps every one."""
        if self._frozen.is_set() or self._listener is None:
            self._try_send(conn, error_reply("busy", "another successor is taking over already; wait for it"))
            return
        self._frozen.set()
        log.info("handing every entry over to pid %d", pid, extra={"peer_pid": pid})
        conn.settimeout(self.config.frame_deadline_s)
        done = False
        try:
            listeners = Listeners(self._listener.fileno(), self._lock_fd, _fileno(self._metrics_listener))
            outcome = send_entries(conn, self.registry, listeners, self._accepting.clear)
            done = outcome == HANDED
            if not done:
                self.metrics.refused(outcome)
        finally:
            if not done:
                self._accepting.set()
                self._frozen.clear()
        if done:
            self._handed_over = True
            readiness.notify(f"MAINPID={pid}")  # under systemd the successor is the unit's main process from now on
            self._try_send(conn, ok_reply(farewell=True))  # after MAINPID=: the successor's notifications come later
            self.stop()

    def _try_send(self, conn: socket.socket, reply: dict, fds=()) -> bool:
        try:
            conn.settimeout(self.config.frame_deadline_s)
            send_frame(conn, reply, fds)
            return True
        except OSError as exc:
            log.warning("could not reply: %s", exc)
            return False


def _fileno(sock: socket.socket | None) -> int:
    return -1 if sock is None else sock.fileno()
