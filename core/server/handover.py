"""Handing a running server's entries to its successor in one sendmsg, so that no instant leaves them with nobody.

A successor (``weightcache serve --take-over``, from this checkout or another:
an upgrade) connects to the running server's socket and sends ``handover``.
The running server (the predecessor) refuses publish, evict and put_artifact
(``busy``) from then on, and:

1. packs every entry into *parcels*. A parcel is a socket pair: the predecessor
   writes one frame per entry into its write end (the entry's record memfd,
   ``core/server/entry_record.py``, then its arena fds and its tensor table's memfd)
   and one per artifact, then closes that end. The read end holds every fd
   written into it, in the kernel, until it is read or closed;
2. stops accepting, then sends one frame, ``{"ok": true, "entries": N, ...}``, with
   its listening socket, its lock file and every parcel's read end: at most
   ``FDS_PER_MESSAGE`` fds, so one sendmsg;
3. waits for the answer: a confirmation (the successor holds every entry and
   accepts on the listener: the predecessor tells the service manager
   ``MAINPID=<successor>``, sends a farewell frame and exits without unlinking
   the path), or a refusal (it resumes serving and says ``resumed``).

That one sendmsg is the handover. Before it the predecessor alone holds the
entries; from it on the successor holds them all too (fds in flight belong to
the receiving socket). A predecessor SIGKILLed at any instant therefore leaves
either a crash before the handover (the successor finds no handover, waits for
the lock to be free and starts as usual: engines re-publish, the fd store gives
back what it kept) or the successor with every entry, the listener (clients
queued there are answered by it) and the lock. A successor that dies at any
instant leaves the predecessor serving every entry. A successor that cannot
admit an entry (the publish check, ``core/server/admission.py``, or its budgets)
refuses the lot if the predecessor acknowledges the refusal; if the predecessor
died meanwhile, nobody else holds the entries, so it serves those that passed
.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Callable

import attrs

from weightcache.core import __version__
from weightcache.core.errors import HandoverFailed, ProtocolError
from weightcache.core.memfd import sealed_size
from weightcache.core.progress import counted
from weightcache.core.server.admission import admit_publish
from weightcache.core.server.entry_record import read_record, sealed_record
from weightcache.core.server.registry import Entry, OverBudget, Registry, TooManyArtifacts
from weightcache.core.socket_dir import SocketDir
from weightcache.core.wire.paths import check_server_peer, peer_credentials
from weightcache.core.wire.protocol import (
    FDS_PER_MESSAGE,
    HEADER,
    FrameReader,
    close_fds,
    encode,
    error_reply,
    ok_reply,
    send_frame,
)

log = logging.getLogger(__name__)

CONFIRM_DEADLINE_S = 60.0
"""How long a predecessor waits for its successor to check every entry and confirm (and a successor for the handover)."""
PAUSE_ENV = "WEIGHTCACHE_HANDOVER_PAUSE_S"
"""Seconds a predecessor pauses after each entry it packs (0 by default): for tests that interrupt a handover."""
ADMIT_PAUSE_ENV = "WEIGHTCACHE_HANDOVER_ADMIT_PAUSE_S"
"""Seconds a successor pauses after each entry it admits (0 by default): for tests that interrupt a handover."""
DIE_AT_ENV = "WEIGHTCACHE_HANDOVER_DIE_AT"
"""A step name (``STEPS``) at which this process SIGKILLs itself: for tests that interrupt a handover at an exact point."""
STEPS = frozenset({"packing", "sent", "refused", "confirmed", "received", "admitting", "confirming"})
"""Predecessor: after its first entry is packed, after the handover frame left, after a refusal arrived, after the
confirmation arrived. Successor: after the handover frame arrived, after its first entry was admitted, before it confirms."""

FAREWELL_WAIT_S = 2.0
"""How long a successor that confirmed waits for its predecessor's farewell (sent after ``MAINPID=``)."""
MAX_PARCELS = FDS_PER_MESSAGE - 3
"""Parcels one handover frame carries beside the listeners and the lock (one sendmsg)."""
_PARCEL_OVERHEAD = 1024  # bytes of kernel bookkeeping counted per sendmsg into a parcel, beyond its data


def _step(name: str) -> None:
    """Die here by SIGKILL if ``$WEIGHTCACHE_HANDOVER_DIE_AT`` names this step (a test's interruption)."""
    if os.environ.get(DIE_AT_ENV) == name:
        log.warning("SIGKILLing myself at handover step %r (%s is set)", name, DIE_AT_ENV)
        os.kill(os.getpid(), signal.SIGKILL)


def _pause(variable: str) -> None:
    seconds = float(os.environ.get(variable) or 0)
    if seconds:
        time.sleep(seconds)


class Parcels:
    """Socket pairs whose read ends hold frames, with their fds, in the kernel until read.

    ``put`` writes a frame into the current parcel, opening a new one when the
    frame would not fit its send buffer (half of ``SO_SNDBUF``: nobody reads
    a parcel while it is filled). Writes do not block: a frame the buffer cannot
    take raises BlockingIOError (never a wait on poll, which reports a unix
    socket writable only below a quarter of its buffer). ``seal`` closes the write end, so a reader sees
    the end of the parcel; ``close`` also closes the read ends this process holds.
    """

    def __init__(self) -> None:
        self.read_ends: list[socket.socket] = []
        self._writer: socket.socket | None = None
        self._room = 0

    def put(self, message: dict, fds: list[int]) -> None:
        cost = HEADER.size + len(encode(message)) + _PARCEL_OVERHEAD * (1 + len(fds) // FDS_PER_MESSAGE)
        writer = self._writer
        if writer is None or cost > self._room:
            writer = self._open(cost)
        send_frame(writer, message, fds)
        self._room -= cost

    def _open(self, cost: int) -> socket.socket:
        self.seal()
        if len(self.read_ends) >= MAX_PARCELS:
            raise ValueError(f"the entries need more than {MAX_PARCELS} parcels; hand over fewer entries (evict some)")
        writer, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.read_ends.append(reader)
        self._writer = writer
        writer.setblocking(False)  # nobody reads a parcel while it is filled: a wrong estimate fails instead of hanging
        self._room = writer.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        if cost > self._room:
            raise ValueError(f"a frame of {cost} bytes does not fit a parcel of {self._room} bytes")
        return writer

    def seal(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        self.seal()
        for reader in self.read_ends:
            reader.close()
        self.read_ends = []


def pack(entries: list[Entry]) -> Parcels:
    """Every entry of ``entries`` and its artifacts, written into sealed parcels (ValueError/OSError: none are left open)."""
    parcels = Parcels()
    try:
        for entry in entries:
            record = sealed_record(entry)
            try:
                parcels.put({"kind": "entry"}, [record, *entry.fds, entry.table_fd])
            finally:
                os.close(record)  # the parcel holds its own reference
            for key, artifact in entry.artifacts.items():
                parcels.put({"kind": "artifact", "digest": entry.digest, "key": key}, [artifact.fd])
            _step("packing")
            _pause(PAUSE_ENV)
        parcels.seal()
    except BaseException:
        parcels.close()
        raise
    return parcels


@attrs.frozen
class Listeners:
    """What a predecessor hands over beside its entries: its socket's listener, its lock and its metrics listener
    (-1: none), so that the successor binds nothing the predecessor holds."""

    listener_fd: int
    lock_fd: int
    metrics_fd: int = -1

    def fds(self) -> list[int]:
        return [self.listener_fd, self.lock_fd] + ([self.metrics_fd] if self.metrics_fd >= 0 else [])


HANDED = "handed"
"""``send_entries``' outcome when the successor holds every entry."""


def send_entries(sock: socket.socket, registry: Registry, listeners: Listeners, pause_accepting: Callable[[], None]) -> str:
    """The predecessor's side: hand every entry of ``registry`` and its ``listeners`` to the successor on ``sock``.

    The caller has frozen the registry (no publish, evict or artifact put runs meanwhile).
    ``pause_accepting`` is called before the listener leaves (newcomers then queue for the successor).
    ``HANDED`` once the successor confirmed it holds every entry; else the refusal code the server counts (logged):
    ``refused`` if the successor refused the entries, ``handover_failed`` if packing failed or the successor went
    away. The caller then resumes serving, having lost nothing.
    """
    entries = registry.snapshot()
    artifacts = sum(len(entry.artifacts) for entry in entries)
    try:
        parcels = pack(entries)
    except (OSError, ValueError) as exc:
        log.warning("could not pack the entries for the successor (%s); serving every entry on", exc)
        _send_quietly(sock, error_reply("handover_failed", f"the running server could not pack its entries: {exc}"))
        return "handover_failed"
    try:
        pause_accepting()
        hello = ok_reply(entries=len(entries), artifacts=artifacts, parcels=len(parcels.read_ends))
        hello.update(pid=os.getpid(), version=__version__, metrics=listeners.metrics_fd >= 0)
        send_frame(sock, hello, [*listeners.fds(), *(parcel.fileno() for parcel in parcels.read_ends)])
        _step("sent")
        frame = FrameReader(sock, deadline_s=CONFIRM_DEADLINE_S).read(idle_timeout=CONFIRM_DEADLINE_S)
    except (OSError, TimeoutError, ProtocolError) as exc:
        log.warning("the handover failed (%s); serving every entry on", exc or type(exc).__name__)
        return "handover_failed"
    finally:
        parcels.close()  # the successor holds its own references to whatever it received
    if frame is None:
        log.warning("the successor went away before it confirmed the handover; serving every entry on")
        return "handover_failed"
    reply, fds = frame
    close_fds(fds)
    if reply.get("ok") is True and reply.get("held") == len(entries):
        _step("confirmed")
        log.info("handed %s and %s to pid %s", counted(len(entries), "entry"), counted(artifacts, "artifact"), reply.get("pid"))
        return HANDED
    _step("refused")
    error = reply.get("error")
    why = error.get("message") if isinstance(error, dict) else None
    if not isinstance(why, str):  # an answer of another shape: say what it held, as JSON
        why = f"it answered {json.dumps(reply, default=str)[:300]}"
    log.warning("the successor refused the handover (%.300s); serving every entry on", why)
    _send_quietly(sock, ok_reply(resumed=True, pid=os.getpid()))
    return "refused"


def _send_quietly(sock: socket.socket, message: dict) -> None:
    try:
        send_frame(sock, message)
    except OSError as exc:
        log.info("could not tell the successor: %s", exc)


@attrs.frozen
class Limits:
    """What a successor accepts from its predecessor: its own frame and artifact limits."""

    max_frame_bytes: int
    max_artifact_bytes: int
    max_artifacts_per_entry: int


@attrs.define
class Handed:
    """What a successor took over: entries (already in its registry), and the listeners and lock.

    ``listener_fd`` and ``lock_fd`` are -1 when no handover happened because the
    predecessor died before it: the successor then binds the socket itself once
    the dead predecessor's lock is free. ``metrics_fd`` is -1 when the predecessor
    served no metrics (or was too old to hand them over).
    """

    entries: int
    artifacts: int
    predecessor_pid: int
    listener_fd: int = -1
    lock_fd: int = -1
    metrics_fd: int = -1
    _sock: socket.socket | None = None

    @property
    def complete(self) -> bool:
        return self.listener_fd >= 0

    def confirm(self) -> None:
        """Tell the predecessor every entry is held here and the listener accepts: it may exit now.

        Then wait (at most ``FAREWELL_WAIT_S``) for its last frame, sent once it told the service manager
        ``MAINPID=<this process>``: what this process tells the service manager afterwards (``FDSTORE=1`` for a
        new entry) is then heard from the unit's main process, not refused.
        """
        if self._sock is None:
            return
        try:
            _step("confirming")
            send_frame(self._sock, ok_reply(held=self.entries, artifacts=self.artifacts, pid=os.getpid()))
            farewell = FrameReader(self._sock, deadline_s=FAREWELL_WAIT_S).read(idle_timeout=FAREWELL_WAIT_S)
            close_fds(farewell[1] if farewell else [])
        except (OSError, ProtocolError) as exc:  # it died after it handed over, or is slow to exit: nothing is lost
            log.info("no farewell from pid %d after the handover: %s", self.predecessor_pid, exc or type(exc).__name__)
        finally:
            self._sock.close()
            self._sock = None


def take_over(socket_dir: SocketDir, registry: Registry, limits: Limits) -> Handed | None:
    """The successor's side: take every entry from the server running on ``socket_dir`` into ``registry``.

    None when no server runs there (start as usual); an incomplete Handed when it died
    before handing over (start as usual once its lock is free). Raises HandoverFailed,
    having closed every fd it received, when the running server refuses or an entry
    fails its check and the running server confirmed it serves on.
    """
    path = socket_dir.socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONFIRM_DEADLINE_S)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        log.info("no server runs on %s: nothing to take over", socket_dir)
        return None
    try:
        check_server_peer(sock, path)
        # SO_PEERCRED names the process that made the listener: after one handover, a server that has exited. The lock
        # file names the server that holds the lock now (each writes its pid there when it starts).
        pid = _pid_in_lock(socket_dir) or peer_credentials(sock)[0]
        send_frame(sock, {"op": "handover", "version": __version__})
        handed = _receive(sock, registry, limits, pid)
    except BaseException:
        sock.close()
        registry.close()
        raise
    return handed


def _pid_in_lock(socket_dir: SocketDir) -> int:
    """The pid the running server wrote into the directory's lock file (0: none readable)."""
    try:
        with open(socket_dir.lock, "rb") as lock:
            text = lock.read(32).decode(errors="replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def _receive(sock: socket.socket, registry: Registry, limits: Limits, pid: int) -> Handed:
    first = _read(FrameReader(sock, limits.max_frame_bytes, CONFIRM_DEADLINE_S))
    if first is None:
        log.warning(
            "the running server (pid %d) closed the connection before it handed anything over; "
            "starting as after a crash once its lock is free (engines re-publish what they map)",
            pid,
        )
        sock.close()
        return Handed(entries=0, artifacts=0, predecessor_pid=pid)
    hello, fds = first
    if hello.get("ok") is not True:
        close_fds(fds)
        error = hello["error"] if isinstance(hello.get("error"), dict) else {}
        raise HandoverFailed(
            f"the running server refused the handover: {error.get('message', hello)!s:.300}; it keeps serving every entry"
        )
    _step("received")
    try:
        listeners, parcel_fds = _split(hello, fds)
    except (TypeError, ValueError, OSError) as exc:
        close_fds(fds)
        raise HandoverFailed(f"the running server's handover is malformed ({exc}); it keeps serving every entry") from None
    if isinstance(hello.get("pid"), int) and not isinstance(hello.get("pid"), bool):
        pid = hello["pid"]  # the server that answered says who it is
    handed = Handed(entries=0, artifacts=0, predecessor_pid=pid, sock=sock, **attrs.asdict(listeners))
    log.info(
        "taking over %s in %s from pid %d (weightcache %s)",
        counted(hello["entries"], "entry") if isinstance(hello.get("entries"), int) else f"{hello.get('entries')} entries",
        counted(len(parcel_fds), "parcel"),
        pid,
        hello.get("version"),
    )
    failures = _unpack(parcel_fds, registry, limits, handed)
    if (handed.entries, handed.artifacts) != (hello.get("entries"), hello.get("artifacts")) and not failures:
        failures.append(f"{handed.entries} entries and {handed.artifacts} artifacts came, not {hello.get('entries')}")
    if failures and _predecessor_serves_on(sock, failures):
        close_fds(listeners.fds())
        raise HandoverFailed(
            f"an entry from the running server failed its check ({failures[0]:.300}); nothing was taken over "
            "and it keeps serving every entry"
        )
    if failures:
        handed._sock = None
        log.warning(
            "the predecessor (pid %d) died during the handover: serving the %s that passed their check; "
            "%d failed and are gone unless an engine re-publishes them (first: %.300s)",
            pid,
            counted(handed.entries, "entry"),
            len(failures),
            failures[0],
        )
    return handed


def _split(hello: dict, fds: list[int]) -> tuple[Listeners, list[int]]:
    """The listeners, the lock and the parcels of a handover frame, each checked for its file type."""
    with_metrics = hello.get("metrics") is True
    listed = 3 if with_metrics else 2
    if len(fds) != listed + int(hello["parcels"]):
        raise ValueError(f"{len(fds)} fds came for {hello['parcels']} parcels, {listed - 1} listeners and a lock")
    listeners = Listeners(fds[0], fds[1], fds[2] if with_metrics else -1)
    parcel_fds = fds[listed:]
    checks = [(listeners.listener_fd, "listener", stat.S_ISSOCK), (listeners.lock_fd, "lock", stat.S_ISREG)]
    checks += [(listeners.metrics_fd, "metrics listener", stat.S_ISSOCK)] if with_metrics else []
    for fd, what, kind in checks + [(fd, "parcel", stat.S_ISSOCK) for fd in parcel_fds]:
        if not kind(os.fstat(fd).st_mode):
            raise ValueError(f"the {what} fd is of the wrong file type")
    return listeners, parcel_fds


def _unpack(parcel_fds: list[int], registry: Registry, limits: Limits, handed: Handed) -> list[str]:
    """Admit every entry and artifact of the parcels into ``registry``; why each one that failed failed."""
    failures: list[str] = []
    parcels = [socket.socket(fileno=fd) for fd in parcel_fds]
    try:
        for parcel in parcels:
            parcel.settimeout(CONFIRM_DEADLINE_S)
            reader = FrameReader(parcel, limits.max_frame_bytes, CONFIRM_DEADLINE_S)
            while (frame := _read(reader)) is not None:
                message, fds = frame
                try:
                    if message.get("kind") == "entry":
                        _adopt_entry(registry, fds, limits)
                        handed.entries += 1
                        _step("admitting")
                        _pause(ADMIT_PAUSE_ENV)
                    elif message.get("kind") == "artifact":
                        _adopt_artifact(registry, message, fds, limits)
                        handed.artifacts += 1
                    else:
                        raise ValueError(f"unknown handover frame {message.get('kind')!r:.40}")
                except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OSError) as exc:
                    close_fds(fds)
                    failures.append(str(exc) or type(exc).__name__)
                except (OverBudget, TooManyArtifacts) as exc:
                    failures.append(str(exc))
    finally:
        for parcel in parcels:
            parcel.close()  # what was not read is closed with it
    return failures


def _read(reader: FrameReader) -> tuple[dict, list[int]] | None:
    try:
        return reader.read(idle_timeout=CONFIRM_DEADLINE_S)
    except (ConnectionResetError, BrokenPipeError):
        return None
    except ProtocolError as exc:
        if "closed in the middle" in str(exc):
            return None
        raise HandoverFailed(f"the running server's handover broke the wire format ({exc}); it keeps serving") from None
    except TimeoutError:
        raise HandoverFailed("the running server stopped sending its entries; it keeps serving") from None


def _predecessor_serves_on(sock: socket.socket, failures: list[str]) -> bool:
    """Refuse the handover; True if the predecessor acknowledged it serves on, False if it died meanwhile."""
    try:
        send_frame(sock, error_reply("refused", f"{len(failures)} entries failed their check: {failures[0]:.300}"))
        frame = _read(FrameReader(sock, deadline_s=CONFIRM_DEADLINE_S))
    except (OSError, HandoverFailed):
        return False
    finally:
        sock.close()
    if frame is None:
        return False
    reply, fds = frame
    close_fds(fds)
    return reply.get("resumed") is True


def _adopt_entry(registry: Registry, fds: list[int], limits: Limits) -> None:
    """Admit one entry (fds: its record, its arenas, its table); on failure the caller closes ``fds``."""
    if len(fds) < 2:
        raise ValueError(f"an entry comes with its record, its arenas and its table, not {len(fds)} fds")
    record = read_record(fds[0])
    entry = admit_publish(record, fds[1:], int(record["published_by"]), limits.max_frame_bytes)
    entry.created = float(record["created"])
    entry.verified = record.get("verified", True) is not False  # a predecessor's unverified entry stays unverified
    try:
        registry.publish(entry, evict=False)  # False: held already (adopted from systemd's fd store)
    except OverBudget:
        close_fds(fds[1:])
        raise
    finally:
        close_fds(fds[:1])


def _adopt_artifact(registry: Registry, message: dict, fds: list[int], limits: Limits) -> None:
    if len(fds) != 1:
        raise ValueError(f"an artifact comes with one fd, not {len(fds)}")
    nbytes = sealed_size(fds[0], "an artifact")
    if nbytes > limits.max_artifact_bytes:
        raise ValueError(f"an artifact of {nbytes} bytes exceeds this server's --max-artifact-bytes")
    try:
        registry.put_artifact(str(message["digest"]), str(message["key"]), fds[0], nbytes, limits.max_artifacts_per_entry)
    except (OverBudget, TooManyArtifacts):
        close_fds(fds)
        raise
