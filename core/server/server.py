"""The weightcache server: holds arena fds and manifests, answers publish/attach/status/evict.

Beside an entry it keeps a few artifacts (compile caches), each a sealed memfd
it never reads: ``put_artifact`` and ``get_artifact``.

It never imports torch or CUDA: it only keeps file descriptors open, which is
what keeps the memory alive. One thread per connection; an engine's attach
session is its connection, so a dead engine detaches by itself.

No single peer can exhaust it (docs/protocol.md, "Limits"): frames are
bounded in bytes and fds, unfinished frames share server-wide caps, idle
connections time out or make room for newcomers, and running out of fds at
accept() sheds idle connections instead of ending the server.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import platform
import resource
import signal
import socket
import stat
import sys
import threading
import time
import typing
from pathlib import Path

import attrs

from weightcache.core import PROTOCOL_VERSION, __version__
from weightcache.core.errors import AccessDenied
from weightcache.core.fingerprint import HOST_TIER
from weightcache.core.progress import counted
from weightcache.core.server import bounds, readiness
from weightcache.core.server.connections import OUT_OF_RESOURCES, SHED_WHEN_OUT_OF_FDS, ConnectionTable
from weightcache.core.server.exporter import Exporter, Verdict
from weightcache.core.server.fdstore import FdStore, adopt, passed_fds
from weightcache.core.server.handover import Handed, Limits
from weightcache.core.server.handover import take_over as take_over_from
from weightcache.core.server.http_endpoint import bind as bind_tcp
from weightcache.core.server.http_endpoint import check_listening, listens_on
from weightcache.core.server.metrics import Metrics
from weightcache.core.server.reexec import spawn_successor
from weightcache.core.server.registry import Budgets, Registry
from weightcache.core.server.requests import Requests
from weightcache.core.server.rewarm import STATES as WARM_STATES
from weightcache.core.server.rewarm import Warmer, scrub_in_background
from weightcache.core.server.serve_config import ConfigError, ServeSource
from weightcache.core.server.sessions import Sessions
from weightcache.core.socket_dir import SocketDir, to_socket_dir
from weightcache.core.wire.paths import ensure_private_dir
from weightcache.core.wire.protocol import FRAME_DEADLINE_S, MAX_FRAME_BYTES, InFlight

log = logging.getLogger(__name__)

LISTEN_BACKLOG = max(socket.SOMAXCONN, 4096)  # the kernel caps it at net.core.somaxconn
_ACCEPT_BACKOFF_S = (0.01, 0.5)
_DEAD_PREDECESSOR_WAIT_S = 5.0  # how long a successor waits for the lock of a predecessor that died during the handover
LIVENESS_STALL_S = 10.0
"""``/healthz`` fails once the accept loop has not gone round for this long (it goes round every 0.2 s)."""
_FAILURE_BURST_GAP_S = 10.0  # failed accepts closer together than this are one burst (one log line)


@attrs.frozen
class ServerConfig:
    """How a server runs.

    :param socket_dir: private directory (0700) holding the socket and the lock.
    :param byte_budget: most bytes of arenas and artifacts held at once, in all tiers (None: no limit).
    :param host_budget: most bytes held on the host tier (host memfd arenas and artifacts; None: no limit).
    :param gpu_budget: most bytes of CUDA arenas held on each GPU (None: no limit).
    :param max_frame_bytes: most payload bytes of one frame.
    :param frame_deadline_s: a frame must arrive whole within this time of its first byte.
    :param max_connections: connections served at once (also at most half the open-file limit);
        a newcomer beyond it displaces the longest-idle connection, or gets ``busy`` when none is idle.
    :param idle_timeout_s: a connection with nothing attached and no request is closed after this long
        (None: never); attached connections stay open as long as their engine keeps them.
    :param max_inflight_fds: most fds held by unfinished frames of all connections together
        (None: a quarter of the open-file limit).
    :param max_inflight_bytes: most payload bytes of unfinished frames of all connections together.
    :param inflight_wait_s: how long a frame waits for ``max_inflight_bytes`` to make room before it is refused with ``busy``.
    :param max_artifact_bytes: largest artifact (a compile cache blob) kept beside an entry.
    :param max_artifacts_per_entry: most artifacts kept beside one entry (a put under a known key replaces).
    :param metrics_port: serve Prometheus metrics over HTTP on this port (None: not at all; needs the ``metrics``
        extra, prometheus-client; 0: any free port, logged).
    :param metrics_host: the address the metrics endpoint binds (loopback by default: metrics name the models held).

    Every number is checked against its range in ``weightcache.core.server.bounds`` (the one the CLI parses with):
    a NaN, infinite, negative, zero or absurd value is a ValueError here, before anything is bound.
    """

    socket_dir: SocketDir = attrs.field(converter=to_socket_dir)
    byte_budget: int | None = attrs.field(default=None, validator=bounds.BUDGET.validator)
    host_budget: int | None = attrs.field(default=None, validator=bounds.BUDGET.validator)
    gpu_budget: int | None = attrs.field(default=None, validator=bounds.BUDGET.validator)
    max_frame_bytes: int = attrs.field(default=MAX_FRAME_BYTES, validator=bounds.FRAME_BYTES.validator)
    frame_deadline_s: float = attrs.field(default=FRAME_DEADLINE_S, validator=bounds.SECONDS.validator)
    max_connections: int = attrs.field(default=1024, validator=bounds.CONNECTIONS.validator)
    idle_timeout_s: float | None = attrs.field(default=120.0, validator=bounds.IDLE_SECONDS.validator)
    max_inflight_fds: int | None = attrs.field(default=None, validator=bounds.IN_FLIGHT_FDS.validator)
    max_inflight_bytes: int = attrs.field(default=256 << 20, validator=bounds.BYTES.validator)
    inflight_wait_s: float = attrs.field(default=1.0, validator=bounds.SECONDS.validator)
    max_artifact_bytes: int = attrs.field(default=1 << 30, validator=bounds.BYTES.validator)
    max_artifacts_per_entry: int = attrs.field(default=16, validator=bounds.ARTIFACTS.validator)
    metrics_port: int | None = attrs.field(default=None, validator=bounds.PORT.validator)
    metrics_host: str = "127.0.0.1"


class ServerAlreadyRunning(AccessDenied):
    """Another server holds the lock of this socket directory."""


class Server(Sessions, Requests):
    """A running server; ``start()`` binds, ``serve_forever()`` answers until ``stop()``."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics()
        self._requester = threading.local()  # the pid whose request runs on this thread (logged with evictions)
        self.registry = Registry(
            Budgets(total=config.byte_budget, host=config.host_budget, per_gpu=config.gpu_budget),
            on_drop=lambda digest, why: self.metrics.evicted(digest, why, getattr(self._requester, "pid", None)),
        )
        self._listener: socket.socket | None = None
        self._lock_fd = -1
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._table = ConnectionTable(config.max_connections)
        # Both limits are fitted to the open-file limit in start() (_size_limits).
        self._in_flight = InFlight(config.max_inflight_fds or 1024, config.max_inflight_bytes, config.inflight_wait_s)
        self._frozen = threading.Event()  # handing over: entries must not change
        self._accepting = threading.Event()  # cleared while the listener is being handed over
        self._accepting.set()
        self._handed_over = False
        self.warmer: Warmer | None = None
        self.fdstore: FdStore | None = None  # systemd's, when the server runs under it with FileDescriptorStoreMax=
        self._failed_accepts = 0  # in a row: they set the back-off
        self._last_failed_accept = float("-inf")
        self._exporter: Exporter | None = None
        self._metrics_listener: socket.socket | None = None
        self._bound_path = False  # the socket file is this server's to remove
        self._heartbeat = time.monotonic()  # the accept loop's last round (liveness)

    @property
    def socket_path(self) -> Path:
        return self.config.socket_dir.socket

    def start(self, handed: Handed | None = None) -> None:
        """Take the directory's lock, clear a dead server's socket, bind and listen; or use the ones a predecessor ``handed``.

        Every listener (the socket, and the metrics port if set) is bound and checked before readiness is
        announced; if one fails, ListenerUnavailable (or AccessDenied, ServerAlreadyRunning) and nothing is left
        behind: no socket file, no lock held, no port bound.
        """
        ensure_private_dir(self.config.socket_dir.path)
        self._size_limits(_raise_fd_limit())
        exporter = self._new_exporter()  # without prometheus-client: an ImportError before anything is bound
        try:
            if handed is not None and handed.complete:
                self._lock_fd, self._listener = handed.lock_fd, socket.socket(fileno=handed.listener_fd)
                os.ftruncate(self._lock_fd, 0)
                os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
                self._listener.settimeout(0.2)
            else:
                self._take_lock(self.config.socket_dir, waiting=handed is not None)
            self._metrics_listener = self._open_metrics_listener(handed)
            if self._listener is None:
                self._listen()
            check_listening(typing.cast(socket.socket, self._listener), "the server's socket")
            if exporter is not None and self._metrics_listener is not None:
                exporter.serve(self._metrics_listener)
                self._exporter = exporter
        except BaseException:
            if exporter is not None:
                exporter.close()
            self._release()
            raise
        self._heartbeat = time.monotonic()
        self._bound_path = True  # this server's to remove when it stops (unless it hands it over)
        took = handed is not None and handed.complete
        how = "took over" if took else "serving on"
        log.info("weightcache server %s (protocol %d) %s %s", __version__, PROTOCOL_VERSION, how, self.socket_path)
        if not took:  # a successor is heard once the predecessor named it MAINPID= (start_server, after confirm)
            readiness.ready(self.socket_path)

    def _new_exporter(self) -> Exporter | None:
        if self.config.metrics_port is None:
            return None
        return Exporter(self.metrics_snapshot, self.liveness, self.readiness)

    def _open_metrics_listener(self, handed: Handed | None) -> socket.socket | None:
        """The metrics listener: the predecessor's if it listens where this server is told to, else a new one."""
        passed = socket.socket(fileno=handed.metrics_fd) if handed is not None and handed.metrics_fd >= 0 else None
        host, port = self.config.metrics_host, self.config.metrics_port
        if passed is not None and port is not None and listens_on(passed, host, port):
            return passed
        if passed is not None:
            passed.close()  # this server listens elsewhere, or not at all; the predecessor's copy goes with it
        return None if port is None else bind_tcp(host, port)

    def _take_lock(self, socket_dir: SocketDir, waiting: bool) -> None:
        """Take the lock (``waiting``: a moment for a predecessor that died during a handover)."""
        self._lock_fd = os.open(socket_dir.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # A predecessor that died during a handover may still be tearing down (its lock goes last): wait a little.
        deadline = time.monotonic() + (_DEAD_PREDECESSOR_WAIT_S if waiting else 0)
        try:
            while not _try_lock(self._lock_fd) and time.monotonic() < deadline:
                time.sleep(0.02)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise ServerAlreadyRunning(
                f"a weightcache server (pid {other}) already serves {socket_dir}; "
                "stop it first or start this one with another --socket-dir"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    def _listen(self) -> None:
        """Bind the socket (the lock is held, so a socket file there is a dead server's) and listen."""
        self._remove_stale_socket()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(self.socket_path))
            self._bound_path = True
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old_umask)
        self._listener = listener
        os.chmod(self.socket_path, 0o600)
        listener.listen(LISTEN_BACKLOG)
        listener.settimeout(0.2)

    def _release(self) -> None:
        """Close every listener and the lock; remove the socket file if this server bound it (a start that failed)."""
        if self._metrics_listener is not None:
            self._metrics_listener.close()
            self._metrics_listener = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._bound_path:
            self._bound_path = False
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _size_limits(self, open_files: int) -> None:
        """Fit the connection and in-flight fd limits to the open-file limit: half for connections, a quarter for frames."""
        self._table.limit = max(1, min(self.config.max_connections, open_files // 2))
        self._in_flight.max_fds = self.config.max_inflight_fds or max(1, open_files // 4)
        if self._table.limit < self.config.max_connections:
            log.warning("serving at most %d connections: the open-file limit is %d", self._table.limit, open_files)

    def _remove_stale_socket(self) -> None:
        """We hold the lock, so a socket file left here belongs to a dead server."""
        try:
            info = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise AccessDenied(f"{self.socket_path} exists and is not a socket; remove it by hand")
        log.warning("removing the stale socket of a dead server at %s", self.socket_path)
        os.unlink(self.socket_path)

    def serve_forever(self) -> None:
        """Accept connections until ``stop()``; then close every fd and remove the socket."""
        if self._listener is None:
            self.start()
        try:
            while not self._stopping.is_set():
                self._heartbeat = time.monotonic()
                if not self._accepting.wait(0.2):
                    continue  # the listener is being handed over: newcomers wait in its queue
                listener = self._listener
                if listener is None:  # closed by stop()
                    break
                try:
                    conn, _ = listener.accept()
                except (TimeoutError, InterruptedError):
                    continue
                except OSError as exc:
                    if self._stopping.is_set():
                        break
                    if exc.errno in OUT_OF_RESOURCES:
                        self._accept_failed(exc)
                        continue
                    if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                        continue
                    raise
                self._failed_accepts = 0
                self._spawn(conn)
        finally:
            self._shutdown()

    def _accept_failed(self, exc: OSError) -> None:
        """Out of fds or memory at accept(): never fatal. Log once per burst, shed idle connections, back off, go on."""
        now = time.monotonic()
        if now - self._last_failed_accept > _FAILURE_BURST_GAP_S:
            log.warning(
                "accept() failed: %s; closing idle connections and backing off (logged once per burst)", exc.strerror or exc
            )
        self._last_failed_accept = now
        self._failed_accepts += 1
        if not self._table.shed_idle(SHED_WHEN_OUT_OF_FDS, "to free file descriptors"):
            low, high = _ACCEPT_BACKOFF_S
            self._stopping.wait(min(high, low * 2 ** min(self._failed_accepts - 1, 10)))

    def liveness(self) -> Verdict:
        """``/healthz``: the accept loop goes round (a stuck server fails it; a busy one does not)."""
        stalled = time.monotonic() - self._heartbeat
        if stalled > LIVENESS_STALL_S:
            return Verdict(False, f"the accept loop has not run for {stalled:.0f} s")
        return Verdict(True, f"pid {os.getpid()} accepts on {self.socket_path}")

    def readiness(self) -> Verdict:
        """``/readyz`` (and the ``ready`` gauge): listening, not stopping, not handing its entries over."""
        if self._stopping.is_set():
            return Verdict(False, "stopping")
        if self._frozen.is_set():
            return Verdict(False, "handing every entry over to a successor")
        if self._listener is None:
            return Verdict(False, "starting")
        return Verdict(True, f"serving {counted(len(self.registry), 'entry')} on {self.socket_path}")

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler or another thread)."""
        self._stopping.set()

    def keep_warm(self, source: ServeSource) -> None:
        """Load ``source``'s warm list in the background; SIGHUP re-reads the file (budgets and list), evicting nothing."""
        _, items = source.read()
        warmer = self.warmer = Warmer(self.config.socket_dir, items)
        warmer.start()

        def reload() -> None:
            if source.path is None:
                log.info("SIGHUP: the server runs without --config; nothing to re-read, nothing changed")
                return
            try:
                settings, items = source.read()
            except ConfigError as exc:
                log.warning("SIGHUP: kept the settings in force: %s", exc)
                return
            self.change_budgets(**{key: settings.get(key) for key in ("byte_budget", "host_budget", "gpu_budget")})
            warmer.replace(items)
            warm = f"{len(items)} model{'s' if len(items) != 1 else ''} to keep warm" if items else "nothing to keep warm"
            log.info("SIGHUP: re-read %s: budgets %s; %s", source.path, self.registry.budgets.describe(), warm)

        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=reload, daemon=True).start())

    def change_budgets(self, byte_budget: int | None, host_budget: int | None, gpu_budget: int | None) -> None:
        """New budgets, in force from the next publish: nothing is evicted now, an attached entry never."""
        self.config = attrs.evolve(self.config, byte_budget=byte_budget, host_budget=host_budget, gpu_budget=gpu_budget)
        self.registry.budgets = Budgets(total=byte_budget, host=host_budget, per_gpu=gpu_budget)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the server cleanly; SIGUSR2 restarts it in place (``core/server/reexec.py``)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop())
        signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=self._restart_in_place, daemon=True).start())

    def _restart_in_place(self) -> None:
        """Start this server's successor (``serve --take-over`` with this command line); it takes every entry over."""
        if self._frozen.is_set():
            log.warning("SIGUSR2 ignored: a successor is taking over already")
            return
        try:
            spawn_successor(sys.argv[1:], lambda: self._handed_over)
        except (OSError, ValueError) as exc:
            log.warning("SIGUSR2: could not start a successor (%s); serving on", exc)

    def metrics_snapshot(self, rows: list[dict] | None = None) -> dict:
        """The metrics' JSON (``Metrics.snapshot``) with the registry's, the process's and the warm list's gauges; also
        what the exporter renders."""
        rows = self.registry.status()[0] if rows is None else rows
        tiers = {HOST_TIER: {"held": 0, "budget": self.registry.budgets.of(HOST_TIER)}, **self.registry.tiers()}
        snapshot = self.metrics.snapshot(tiers, self.registry.budgets.to_json(), len(self.registry), self._table.open_count())
        by_device: dict[str, int] = {}
        for row in rows:
            by_device[row["device"]] = by_device.get(row["device"], 0) + 1
        store = self.fdstore
        return {
            **snapshot,
            "entries_by_device": by_device,
            "unverified_entries": sum(1 for row in rows if row.get("verified") is False),
            "ready": self.readiness().ok,
            "build": {"version": __version__, "protocol": PROTOCOL_VERSION, "python": platform.python_version()},
            "open_fds": _open_fds(),
            "max_fds": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "fdstore": store is not None,
            "fdstore_fds": sum(store.kept.values()) if store is not None else 0,
            "fdstore_failures": store.failures if store is not None else 0,
            "warm_items": self.warmer.counts() if self.warmer is not None else dict.fromkeys(WARM_STATES, 0),
        }

    def _shutdown(self) -> None:
        log.info("server stopping" + (": a successor serves every entry" if self._handed_over else ""))
        if self.warmer is not None:
            self.warmer.stop()
        if not self._handed_over:  # else the unit goes on, with the successor as its main process
            readiness.notify("STOPPING=1")
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        if self._handed_over:  # the path is the successor's now
            self._bound_path = False
        lock, self._lock_fd = self._lock_fd, -1  # the lock goes last: a successor waits for it
        self._release()
        self._table.close_all()
        self.registry.close(handed_over=self._handed_over)
        if lock >= 0:
            os.close(lock)


def _open_fds() -> int:
    """Fds this process holds (every arena is one; compare ``max_fds``); -1 where /proc is not mounted."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError:
        return -1


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _raise_fd_limit() -> int:
    """Lift the soft limit on open fds to the hard one and return it: the server holds every arena's fd, and one
    frame may carry up to MAX_FDS of them (more than the common default soft limit of 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return target if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft
    return target


def start_server(config: ServerConfig, take_over: bool = False, source: ServeSource | None = None) -> Server:
    """A started server in this process, stopped by SIGTERM or SIGINT; with ``take_over``, holding every entry of the
    server running on the same directory, which exits once this one accepts (HandoverFailed: it serves on).

    ``source``: the config file it came from; its warm list is loaded in the background and SIGHUP re-reads it.
    """
    server = Server(config)
    server.install_signal_handlers()
    store = FdStore.from_environ()
    adopted = adopt(server.registry, passed_fds(), config.max_frame_bytes)
    if store is not None:
        server.fdstore = store
        server.registry.on_publish, server.registry.on_evict = store.keep, store.forget
        for entry in server.registry.snapshot():
            store.keep(entry)
    handed = None
    if take_over:
        limits = Limits(config.max_frame_bytes, config.max_artifact_bytes, config.max_artifacts_per_entry)
        if store is not None:  # the predecessor's fds of these entries are in the store already, under the same names
            server.registry.on_publish = store.note
        try:
            handed = take_over_from(config.socket_dir, server.registry, limits)
        finally:
            if store is not None:
                server.registry.on_publish = store.keep
    server.start(handed)
    if handed is not None:
        handed.confirm()
        if handed.complete:
            readiness.ready(server.socket_path)  # heard now: the predecessor named this process MAINPID=
    if adopted:
        scrub_in_background(config.socket_dir)
    if source is not None:
        server.keep_warm(source)
    return server


def serve(config: ServerConfig, take_over: bool = False, source: ServeSource | None = None) -> None:
    """Run a server in this process until SIGTERM or SIGINT (``take_over``, ``source``: see ``start_server``)."""
    start_server(config, take_over, source).serve_forever()
