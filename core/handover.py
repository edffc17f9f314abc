"""Handing a running server's entries to its successor: every fd and manifest over the socket, then the listener.

A successor (``weightcache serve --take-over``, from this checkout or another:
an upgrade) connects to the running server's socket and sends ``handover``.
The running server (the predecessor) refuses publish, evict and put_artifact
(``busy``) from then on, and sends, on that connection:

1. ``{"ok": true, "entries": N, ...}``;
2. per entry, one frame: its fingerprint, manifest (JSON part), label, publisher and age,
   with its arena fds and then its tensor table's sealed memfd (what a publish carries);
   per artifact, one frame with its sealed memfd;
3. it stops accepting (newcomers wait in the listen queue), then sends
   ``{"kind": "end", ...}`` with two fds: its listening socket and its lock file.

Every frame stays within the wire's limits (``core/protocol.py``: at most
``FDS_PER_MESSAGE`` fds per sendmsg, ``MAX_FDS`` per frame: an entry arrived in
one publish frame, so it leaves in one). The successor checks each entry as a
publish is checked (``admit_publish``), accepts on the listening socket it was
given, and confirms how many entries it holds. Only then does the predecessor
exit; until then it holds every entry and resumes serving if the successor
fails or dies (docs/decisions.md, 37). The fds are never closed in between:
in flight, the kernel holds them.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

import attrs

from weightcache.core import __version__
from weightcache.core.admission import admit_publish
from weightcache.core.errors import HandoverFailed, ProtocolError
from weightcache.core.memfd import sealed_size
from weightcache.core.paths import check_server_peer
from weightcache.core.protocol import FrameReader, close_fds, ok_reply, send_frame
from weightcache.core.registry import OverBudget, Registry, TooManyArtifacts
from weightcache.core.socket_dir import SocketDir

log = logging.getLogger(__name__)

CONFIRM_DEADLINE_S = 60.0
"""How long a predecessor waits for its successor to check every entry and confirm."""
PAUSE_ENV = "WEIGHTCACHE_HANDOVER_PAUSE_S"
"""Seconds a predecessor pauses after each entry it sends (0 by default): for tests that interrupt a handover."""


@attrs.frozen
class Limits:
    """What a successor accepts from its predecessor: its own frame and artifact limits."""

    max_frame_bytes: int
    max_artifact_bytes: int
    max_artifacts_per_entry: int


@attrs.define
class Handed:
    """What a successor took over: entries (already in its registry), and the listener and lock when the handover completed.

    ``listener_fd`` and ``lock_fd`` are -1 when the predecessor died before it sent them:
    the successor then binds the socket itself (the dead predecessor's lock is free).
    """

    entries: int
    artifacts: int
    predecessor_pid: int
    listener_fd: int = -1
    lock_fd: int = -1
    _sock: socket.socket | None = None

    @property
    def complete(self) -> bool:
        return self.listener_fd >= 0

    def confirm(self) -> None:
        """Tell the predecessor every entry is held here and the listener accepts: it may exit now."""
        if self._sock is None or not self.complete:
            return
        try:
            send_frame(self._sock, ok_reply(held=self.entries, artifacts=self.artifacts, pid=os.getpid()))
        except OSError as exc:  # it died after it sent everything: nothing is lost
            log.warning("could not confirm the handover to pid %d: %s", self.predecessor_pid, exc)
        finally:
            self._sock.close()
            self._sock = None


def send_entries(
    sock: socket.socket, registry: Registry, listener_fd: int, lock_fd: int, pause_accepting: Callable[[], None]
) -> bool:
    """The predecessor's side: send every entry of ``registry`` on ``sock``, then the listener and the lock.

    The caller has frozen the registry (no publish, evict or artifact put runs meanwhile).
    ``pause_accepting`` is called before the listener leaves (newcomers then queue for the successor).
    True once the successor confirmed it holds every entry; False (logged) if it
    failed or went away: the caller then resumes serving, having lost nothing.
    """
    entries = registry.snapshot()
    artifacts = sum(len(entry.artifacts) for entry in entries)
    pause_s = float(os.environ.get(PAUSE_ENV) or 0)
    try:
        send_frame(sock, ok_reply(entries=len(entries), artifacts=artifacts, pid=os.getpid(), version=__version__))
        for entry in entries:
            message = {
                "kind": "entry",
                "fingerprint": entry.fingerprint.to_json(),
                "manifest": entry.manifest,
                "label": entry.label,
                "published_by": entry.published_by,
                "created": entry.created,
            }
            send_frame(sock, message, [*entry.fds, entry.table_fd])
            for key, artifact in entry.artifacts.items():
                send_frame(sock, {"kind": "artifact", "digest": entry.digest, "key": key}, [artifact.fd])
            if pause_s:
                time.sleep(pause_s)
        pause_accepting()
        send_frame(sock, {"kind": "end", "entries": len(entries), "artifacts": artifacts}, [listener_fd, lock_fd])
        frame = FrameReader(sock, deadline_s=CONFIRM_DEADLINE_S).read(idle_timeout=CONFIRM_DEADLINE_S)
    except (OSError, TimeoutError, ProtocolError) as exc:
        log.warning("the handover failed (%s); serving every entry on", exc or type(exc).__name__)
        return False
    if frame is None:
        log.warning("the successor went away before it confirmed the handover; serving every entry on")
        return False
    reply, fds = frame
    close_fds(fds)
    if reply.get("ok") is not True or reply.get("held") != len(entries):
        log.warning("the successor did not confirm the handover (%.300s); serving every entry on", reply)
        return False
    log.info("handed %d entries and %d artifacts to pid %s", len(entries), artifacts, reply.get("pid"))
    return True


def take_over(socket_dir: SocketDir, registry: Registry, limits: Limits) -> Handed | None:
    """The successor's side: take every entry from the server running on ``socket_dir`` into ``registry``.

    None when no server runs there (start as usual). Raises HandoverFailed, having
    closed every fd it received, when the running server refuses or an entry
    fails its check: the running server then keeps serving every entry.
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
        send_frame(sock, {"op": "handover", "version": __version__})
        handed = _receive(sock, registry, limits)
    except BaseException:
        sock.close()
        registry.close()
        raise
    if not handed.complete:
        sock.close()
    return handed


def _receive(sock: socket.socket, registry: Registry, limits: Limits) -> Handed:
    reader = FrameReader(sock, limits.max_frame_bytes, CONFIRM_DEADLINE_S)
    first = _read(reader)
    if first is None:
        raise HandoverFailed("the running server closed the connection instead of handing over; it keeps serving")
    hello, fds = first
    close_fds(fds)
    if hello.get("ok") is not True:
        error = hello["error"] if isinstance(hello.get("error"), dict) else {}
        raise HandoverFailed(
            f"the running server refused the handover: {error.get('message', hello)!s:.300}; it keeps serving every entry"
        )
    handed = Handed(entries=0, artifacts=0, predecessor_pid=int(hello.get("pid", 0)), sock=sock)
    log.info(
        "taking over %s entries from pid %d (weightcache %s)", hello.get("entries"), handed.predecessor_pid, hello.get("version")
    )
    while True:
        frame = _read(reader)
        if frame is None:
            log.warning(
                "the predecessor (pid %d) died during the handover; serving the %d entries it had sent "
                "(engines re-publish what they still map)",
                handed.predecessor_pid,
                handed.entries,
            )
            return handed
        message, fds = frame
        kind = message.get("kind")
        if kind == "end":
            _finish(handed, message, fds)
            return handed
        try:
            if kind == "entry":
                _adopt_entry(registry, message, fds, limits)
                handed.entries += 1
            elif kind == "artifact":
                _adopt_artifact(registry, message, fds, limits)
                handed.artifacts += 1
            else:
                raise ValueError(f"unknown handover frame {kind!r:.40}")
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OSError, OverBudget, TooManyArtifacts) as exc:
            close_fds(fds)
            raise HandoverFailed(
                f"an entry from the running server failed its check ({exc!s:.300}); nothing was taken over "
                "and it keeps serving every entry"
            ) from None


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


def _adopt_entry(registry: Registry, message: dict, fds: list[int], limits: Limits) -> None:
    entry = admit_publish(message, fds, int(message["published_by"]), limits.max_frame_bytes)
    entry.created = float(message["created"])
    registry.publish(entry, evict=False)  # False: held already (adopted from systemd's fd store)


def _adopt_artifact(registry: Registry, message: dict, fds: list[int], limits: Limits) -> None:
    if len(fds) != 1:
        raise ValueError(f"an artifact comes with one fd, not {len(fds)}")
    nbytes = sealed_size(fds[0], "an artifact")
    if nbytes > limits.max_artifact_bytes:
        raise ValueError(f"an artifact of {nbytes} bytes exceeds this server's --max-artifact-bytes")
    registry.put_artifact(str(message["digest"]), str(message["key"]), fds[0], nbytes, limits.max_artifacts_per_entry)


def _finish(handed: Handed, message: dict, fds: list[int]) -> None:
    if len(fds) != 2 or message.get("entries") != handed.entries or message.get("artifacts") != handed.artifacts:
        close_fds(fds)
        raise HandoverFailed(
            f"the running server ended the handover with {message.get('entries')} entries and {len(fds)} fds, "
            f"but {handed.entries} entries came; it keeps serving every entry"
        )
    handed.listener_fd, handed.lock_fd = fds
