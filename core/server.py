"""The weightcache server: holds arena fds and manifests, answers publish/attach/status/evict.

It never imports torch or CUDA: it only keeps file descriptors open, which is
what keeps the memory alive. One thread per connection; an engine's attach
session is its connection, so a dead engine detaches by itself.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import resource
import signal
import socket
import stat
import struct
import threading
from pathlib import Path

import attrs

from weightcache.core import PROTOCOL_VERSION, __version__
from weightcache.core.errors import AccessDenied, ProtocolError
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.paths import LOCK_NAME, SOCKET_NAME, ensure_private_dir
from weightcache.core.protocol import (
    FRAME_DEADLINE_S,
    MAX_FRAME_BYTES,
    FrameReader,
    close_fds,
    error_reply,
    ok_reply,
    send_frame,
)
from weightcache.core.registry import Entry, OverBudget, Registry

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")


@attrs.frozen
class ServerConfig:
    """How a server runs.

    :param socket_dir: private directory (0700) holding the socket and the lock.
    :param byte_budget: most bytes of arenas held at once (None: no limit).
    :param max_connections: connections served at once; more are refused.
    """

    socket_dir: Path = attrs.field(converter=Path)
    byte_budget: int | None = None
    max_frame_bytes: int = MAX_FRAME_BYTES
    frame_deadline_s: float = FRAME_DEADLINE_S
    max_connections: int = 1024


class ServerAlreadyRunning(AccessDenied):
    """Another server holds the lock of this socket directory."""


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of ``conn`` (SO_PEERCRED)."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


class Server:
    """A running server; ``start()`` binds, ``serve_forever()`` answers until ``stop()``."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.registry = Registry(byte_budget=config.byte_budget)
        self._listener: socket.socket | None = None
        self._lock_fd = -1
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._slots = threading.BoundedSemaphore(config.max_connections)
        self._connections: dict[int, socket.socket] = {}
        self._connections_lock = threading.Lock()

    @property
    def socket_path(self) -> Path:
        return self.config.socket_dir / SOCKET_NAME

    def start(self) -> None:
        """Take the directory's lock, clear a dead server's socket, bind and listen."""
        socket_dir = ensure_private_dir(self.config.socket_dir)
        _raise_fd_limit()
        self._lock_fd = os.open(socket_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
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
        self._remove_stale_socket()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        log.info("weightcache server %s (protocol %d) serving on %s", __version__, PROTOCOL_VERSION, self.socket_path)

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
                try:
                    conn, _ = self._listener.accept()
                except (socket.timeout, InterruptedError):
                    continue
                except OSError:
                    if self._stopping.is_set():
                        break
                    raise
                self._spawn(conn)
        finally:
            self._shutdown()

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler or another thread)."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the server cleanly."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop())

    def _spawn(self, conn: socket.socket) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("refusing a connection: %d connections already open", self.config.max_connections)
            self._refuse(conn, "busy", "too many connections; try again shortly")
            return
        connection_id = next(self._ids)
        thread = threading.Thread(target=self._serve_connection, args=(conn, connection_id), daemon=True)
        thread.start()

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        try:
            conn.settimeout(1.0)
            send_frame(conn, error_reply(code, message))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve_connection(self, conn: socket.socket, connection_id: int) -> None:
        with self._connections_lock:
            self._connections[connection_id] = conn
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != os.geteuid():
                log.warning("refused pid %d of uid %d: the server runs as uid %d", pid, uid, os.geteuid())
                self._refuse(conn, "access_denied", f"uid {uid} may not use a server of uid {os.geteuid()}; run the engine as the server's user")
                return
            reader = FrameReader(conn, self.config.max_frame_bytes, self.config.frame_deadline_s)
            while not self._stopping.is_set():
                try:
                    frame = reader.read(idle_timeout=None)
                except ProtocolError as exc:
                    log.warning("protocol error from pid %d: %s", pid, exc)
                    self._try_send(conn, error_reply("protocol_error", str(exc)))
                    return
                except (TimeoutError, OSError) as exc:
                    log.warning("dropping pid %d's connection: %s", pid, exc or type(exc).__name__)
                    return
                if frame is None:
                    return
                message, fds = frame
                reply, reply_fds = self._dispatch(message, fds, connection_id, pid)
                try:
                    if not self._try_send(conn, reply, reply_fds):
                        return
                finally:
                    close_fds(reply_fds)  # our own duplicates, made for this reply
        except Exception:
            log.exception("unexpected error serving connection %d", connection_id)
        finally:
            self.registry.drop_connection(connection_id)
            with self._connections_lock:
                self._connections.pop(connection_id, None)
            conn.close()
            self._slots.release()

    def _try_send(self, conn: socket.socket, reply: dict, fds=()) -> bool:
        try:
            conn.settimeout(self.config.frame_deadline_s)
            send_frame(conn, reply, fds)
            return True
        except OSError as exc:
            log.warning("could not reply: %s", exc)
            return False

    def _dispatch(self, message: dict, fds: list[int], connection_id: int, pid: int) -> tuple[dict, list[int]]:
        op = message.get("op")
        handlers = {
            "hello": self._hello,
            "publish": self._publish,
            "attach": self._attach,
            "detach": self._detach,
            "status": self._status,
            "evict": self._evict,
        }
        handler = handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            close_fds(fds)
            return error_reply("bad_request", f"unknown op {op!r:.80}; expected hello, publish, attach, detach, status or evict"), []
        if op != "publish" and fds:
            close_fds(fds)
            return error_reply("bad_request", f"op {op!r} takes no fds; {len(fds)} were closed"), []
        # A handler that raises has kept none of the fds (publish hands them over only on success).
        try:
            return handler(message, fds, connection_id, pid)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            close_fds(fds)
            return error_reply("bad_request", f"malformed {op} request: {exc!s:.300}"), []
        except BaseException:
            close_fds(fds)
            raise

    def _hello(self, message, fds, connection_id, pid):
        return ok_reply(version=__version__, protocol=PROTOCOL_VERSION, pid=os.getpid(), uid=os.geteuid()), []

    def _publish(self, message, fds, connection_id, pid):
        from weightcache.core.manifest import Manifest  # attrs only; no torch at import
        from weightcache.core.protocol import encode

        try:
            fingerprint = Fingerprint.from_json(message["fingerprint"])
            manifest = Manifest.from_json(message["manifest"])
            if len(fds) != len(manifest.arenas):
                raise ValueError(f"manifest lists {len(manifest.arenas)} arenas but {len(fds)} fds came")
            counted = [
                _check_arena_fd(fd, spec, extent, index)
                for index, (fd, spec, extent) in enumerate(zip(fds, manifest.arenas, manifest.arena_extents()))
            ]
            entry = Entry(
                fingerprint=fingerprint,
                manifest=message["manifest"],
                fds=fds,
                nbytes=sum(counted),
                label=message.get("label", ""),
                published_by=pid,
            )
            reply_bytes = len(encode(entry.manifest)) + _REPLY_ENVELOPE_BYTES  # escaped, it may outgrow the frame it came in
            if reply_bytes > self.config.max_frame_bytes:
                raise ValueError(f"the manifest would need a {reply_bytes}-byte attach reply, past the frame limit; split the model")
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OSError) as exc:
            close_fds(fds)
            return error_reply("bad_request", f"malformed publish request: {exc!s:.600}"), []
        try:
            created = self.registry.publish(entry)
        except OverBudget as exc:
            close_fds(fds)
            return error_reply("over_budget", str(exc)), []
        return ok_reply(digest=entry.digest, created=created), []

    def _attach(self, message, fds, connection_id, pid):
        fingerprint = Fingerprint.from_json(message["fingerprint"])
        found = self.registry.checkout(fingerprint, connection_id, pid)
        if found is None:
            closest, fields = self.registry.closest(fingerprint)
            return error_reply(
                "not_found", f"no entry for fingerprint {fingerprint.short}",
                digest=fingerprint.digest, closest=closest, fields=list(fields),
            ), []
        entry, fds = found
        return ok_reply(digest=entry.digest, manifest=entry.manifest, label=entry.label), fds

    def _detach(self, message, fds, connection_id, pid):
        self.registry.detach(str(message["digest"]), connection_id)
        return ok_reply(), []

    def _status(self, message, fds, connection_id, pid):
        # Rows are bounded (labels and shown texts are short); this bounds their count too, so the reply fits a frame.
        entries, omitted = self.registry.status(max_bytes=self.config.max_frame_bytes - _REPLY_ENVELOPE_BYTES)
        return ok_reply(
            entries=entries,
            omitted=omitted,
            held_bytes=self.registry.held_bytes(),
            byte_budget=self.config.byte_budget,
            pid=os.getpid(),
            version=__version__,
        ), []

    def _evict(self, message, fds, connection_id, pid):
        from weightcache.core.errors import AmbiguousDigest

        try:
            evicted = self.registry.evict(str(message["digest"]), force=bool(message.get("force", False)))
        except KeyError as exc:
            return error_reply("not_found", exc.args[0]), []
        except AmbiguousDigest as exc:
            return error_reply("ambiguous", str(exc), matches=[digest[:12] for digest in exc.matches]), []
        except PermissionError as exc:
            return error_reply("attached", str(exc)), []
        return ok_reply(evicted=evicted), []

    def _shutdown(self) -> None:
        log.info("server stopping")
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        with self._connections_lock:
            for conn in self._connections.values():
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.registry.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


_HOST_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_REPLY_ENVELOPE_BYTES = 4096  # a reply's fields besides its rows (status) or its manifest (attach)
CUDA_GRANULE = 2 << 20
"""Allocation granularity the server assumes for CUDA arenas (the driver's recommended VMM granularity on current GPUs)."""
CUDA_SLACK = 2 << 20
"""Bytes a CUDA arena may declare beyond its tensors' extent rounded up to CUDA_GRANULE (covers granularities up to 4 MiB)."""


def _raise_fd_limit() -> None:
    """Lift the soft limit on open fds to the hard one: the server holds every arena's fd, and one
    frame may carry up to MAX_FDS of them (more than the common default soft limit of 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)




def _check_arena_fd(fd: int, spec, extent: int, index: int) -> int:
    """Check arena ``index``'s fd against its spec and its tensors' ``extent``; the bytes it counts against the budget.

    A host arena must be a memfd sealed against writes, shrinking and growing,
    as large as its spec says (up to one page more): the seals make the bytes
    immutable for every engine, and its real size is what it counts.  A CUDA
    arena's fd cannot be sized without CUDA, so its declared size counts and
    must be plausible: at most its tensors' extent rounded up to CUDA_GRANULE,
    plus CUDA_SLACK (the manifest already checked it is at least that extent).
    """
    if spec.backend not in ("host", "cuda"):
        raise ValueError(f"unknown arena backend {spec.backend!r:.40}; expected 'host' or 'cuda'")
    from weightcache.core.arena.base import round_up

    if spec.backend == "cuda":
        bound = round_up(extent, CUDA_GRANULE) + CUDA_SLACK
        if spec.size > bound:
            raise ValueError(
                f"cuda arena {index} declares {spec.size} bytes but its tensors reach only {extent}; "
                f"an arena may exceed its tensors by its allocation granularity only (at most {bound} bytes here); "
                "export into arenas sized for the tensors they hold"
            )
        return spec.size
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"host arena {index} fd is not a memfd (file type {stat.S_IFMT(info.st_mode):#o})")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError(f"host arena {index} fd is not a memfd (it cannot be sealed)") from None
    if seals & _HOST_SEALS != _HOST_SEALS:
        raise ValueError(f"host arena {index} memfd is not sealed against writes, shrinking and growing; seal it before publishing")
    if info.st_size < spec.size:
        raise ValueError(f"host arena {index} fd is {info.st_size} bytes, manifest says {spec.size}")
    if info.st_size > spec.size + resource.getpagesize():
        raise ValueError(
            f"host arena {index} memfd is {info.st_size} bytes but its manifest declares {spec.size}; "
            "declare the memfd's real size"
        )
    return info.st_size


def serve(config: ServerConfig) -> None:
    """Run a server in this process until SIGTERM or SIGINT."""
    server = Server(config)
    server.install_signal_handlers()
    server.start()
    server.serve_forever()
