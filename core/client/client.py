"""The client side of the wire: publish, attach, detach, status, evict and artifact requests.

A client trusts only its own server: before it sends anything it checks the
socket directory (owned by this user or root, not a symlink, nobody else may
write it) and the process it reached (SO_PEERCRED: this user or root).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

import attrs

from weightcache.core.client.replies import ServerStatus
from weightcache.core.errors import (
    AccessDenied,
    EntryNotFound,
    FingerprintMismatch,
    ProtocolError,
    ServerError,
    ServerUnavailable,
)
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.memfd import read_memfd, sealed_memfd, sealed_size
from weightcache.core.socket_dir import SocketDir, SocketDirLike
from weightcache.core.wire.paths import check_client_dir, check_server_peer
from weightcache.core.wire.protocol import FrameReader, close_fds, send_frame

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
_CONNECT_BACKOFF_S = (0.002, 0.1)  # while the server's listen queue is full


@attrs.frozen
class AttachReply:
    """What the server hands an engine: the entry's digest, its manifest's JSON part and tensor table, and the arena fds
    (owned by the caller); ``manifest()`` puts the manifest together."""

    digest: str
    wire: dict
    table: bytes = attrs.field(repr=False)
    fds: tuple[int, ...]
    label: str
    fingerprint: dict | None = None
    """The entry's fingerprint (JSON), sent when it was attached by digest."""
    verify: bool = False
    """The entry is not verified (it came back after a server crash): check its arenas' checksums before use and send
    ``verified`` (only a client that declared it ``verifies`` is given such an entry)."""

    def manifest(self) -> Manifest:
        """The entry's manifest, as the server checked it (InvalidManifest if the reply is malformed)."""
        return Manifest.from_wire(self.wire, self.table, trusted=True)


@attrs.frozen
class HeldVersion:
    """One version of a lineage the server holds (``Fingerprint.version``): its number, digest and fingerprint."""

    version: int
    digest: str
    fingerprint: Fingerprint

    @classmethod
    def from_json(cls, data: dict) -> "HeldVersion":
        version, digest = data["version"], data["digest"]
        if type(version) is not int or not isinstance(digest, str):
            raise ValueError(f"a version row holds {version!r:.20} and {digest!r:.80}")
        return cls(version, digest, Fingerprint.from_json(data["fingerprint"]))


class Connection:
    """One connection to a server; requests are answered in order.

    An engine keeps the connection that attached an entry open for as long as
    it maps the entry: the server counts it as attached until it closes.
    """

    def __init__(self, socket_dir: SocketDirLike = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.path = SocketDir.parse(socket_dir).socket
        self.timeout = timeout
        try:
            check_client_dir(self.path.parent)
        except FileNotFoundError:
            raise ServerUnavailable(str(self.path), "no socket") from None
        self._answered = False  # no reply yet on this connection
        self._open()

    def _open(self) -> None:
        self._sock = _connect(self.path, self.timeout)
        try:
            check_server_peer(self._sock, self.path)
        except BaseException:
            self._sock.close()
            raise
        self._reader = FrameReader(self._sock, deadline_s=self.timeout)

    def request(self, message: dict, fds: Iterable[int] = ()) -> tuple[dict, list[int]]:
        """Send one request, return the reply and the fds that came with it.

        A refusal that asks to retry (``retry_after_s``: the server is handing over to a successor) is retried
        until the connection's timeout, on a new connection once the old server has gone (its successor answers
        there). A connection that never got a reply and is closed unanswered (accepted by a server that handed
        over and exited) is opened again once. The fds stay the caller's throughout.
        """
        fds = list(fds)
        deadline = time.monotonic() + self.timeout
        asked_to_retry = False
        reopened = False
        while True:
            try:
                reply = self._request_once(message, fds)
                self._answered = True
                return reply
            except ServerError as exc:
                self._answered = True
                wait = exc.retry_after_s
                if wait is None or time.monotonic() + wait > deadline:
                    raise
                asked_to_retry = True
                time.sleep(wait)
            except ServerUnavailable:
                # Never for a connection that was answered before: it may hold attach sessions a new one would not.
                fresh = not self._answered and not reopened
                if not (asked_to_retry or fresh) or time.monotonic() > deadline:
                    raise
                self._sock.close()
                try:
                    self._open()  # the server that accepted us handed over and exited: its successor answers
                except (ServerUnavailable, AccessDenied, OSError):
                    raise ServerUnavailable(str(self.path), "the server closed the connection") from None
                reopened = True

    def _request_once(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        try:
            send_frame(self._sock, message, fds)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # The server may have refused this peer and closed before the request went out: read its reason.
            frame = self._read_refusal()
            if frame is None:
                raise ServerUnavailable(str(self.path), f"connection lost: {exc}") from None
        else:
            frame = None
        try:
            frame = frame or self._reader.read(idle_timeout=self.timeout)  # None: the server closed
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ServerUnavailable(str(self.path), f"connection lost: {exc}") from None
        except TimeoutError:
            raise ServerUnavailable(str(self.path), f"no reply within {self.timeout:.0f} s") from None
        if frame is None:
            raise ServerUnavailable(str(self.path), "the server closed the connection")
        reply, reply_fds = frame
        if reply.get("ok") is True:
            return reply, reply_fds
        close_fds(reply_fds)
        error = reply.get("error")
        if not isinstance(error, dict) or not isinstance(error.get("code"), str) or not isinstance(error.get("message", ""), str):
            raise ProtocolError(
                "the server's reply is neither ok nor an error with a code and a message; "
                "run the same weightcache version on both sides"
            )
        code, text = error["code"], error.get("message", "")
        if code == "access_denied":
            raise AccessDenied(text or "access denied")
        fields, digest, closest = error.get("fields"), error.get("digest", ""), error.get("closest")
        if code == "not_found" and isinstance(fields, list) and all(isinstance(f, str) for f in fields):
            cls = FingerprintMismatch if fields else EntryNotFound
            raise cls(str(digest), tuple(fields), closest if isinstance(closest, str) else None, error.get("unverified") is True)
        retry = error.get("retry_after_s")
        raise ServerError(code, text, retry if isinstance(retry, (int, float)) and 0 < retry <= 1 else None)

    def _read_refusal(self):
        try:
            return self._reader.read(idle_timeout=1.0)
        except (OSError, TimeoutError, ProtocolError):
            return None

    def hello(self) -> dict:
        return self.request({"op": "hello"})[0]

    def publish(self, fingerprint: Fingerprint, manifest: Manifest, fds: Iterable[int], label: str = "") -> dict:
        """Publish an entry: the manifest's JSON part in the frame, its tensor table in a sealed memfd after the arena
        ``fds``. The server duplicates the fds; the caller still owns its own."""
        wire, table = manifest.to_wire()
        table_fd = sealed_memfd(table, "weightcache-tensor-table")
        try:
            message = {"op": "publish", "fingerprint": fingerprint.to_json(), "manifest": wire, "label": label}
            return self.request(message, [*fds, table_fd])[0]
        finally:
            os.close(table_fd)

    def attach(self, fingerprint: Fingerprint, verifies: bool = False) -> AttachReply:
        """Mark the entry attached by this connection and receive its arena fds and its tensor table.

        ``verifies``: this client checksums an entry that is not verified before using it and then sends ``verified``
        (``AttachReply.verify`` says when); without it such an entry is a miss (EntryNotFound).
        """
        return self._attach({"op": "attach", "fingerprint": fingerprint.to_json()}, verifies)

    def attach_digest(self, digest: str, verifies: bool = False) -> AttachReply:
        """Attach the entry whose full digest is ``digest`` (from ``status``); the reply carries its fingerprint."""
        return self._attach({"op": "attach", "digest": digest}, verifies)

    def _attach(self, message: dict, verifies: bool) -> AttachReply:
        reply, fds = self.request({**message, "verifies": True} if verifies else message)
        try:
            if not fds:
                raise KeyError("tensor table fd")
            table = read_memfd(fds[-1], sealed_size(fds[-1], "the tensor table"))
            return AttachReply(
                digest=str(reply["digest"]),
                wire=reply["manifest"],
                table=table,
                fds=tuple(fds[:-1]),
                label=str(reply.get("label", "")),
                fingerprint=reply.get("fingerprint"),
                verify=reply.get("verify") is True,
            )
        except (KeyError, ValueError) as exc:
            close_fds(fds[:-1])  # the table's fd is closed below
            raise ProtocolError(
                f"the server's attach reply lacks or garbles {exc}; run the same weightcache version on both sides"
            ) from None
        finally:
            if fds:
                close_fds(fds[-1:])

    def detach(self, digest: str) -> None:
        self.request({"op": "detach", "digest": digest})

    def verified(self, digest: str, checksums: "list[str | None]") -> bool:
        """Tell the server that entry ``digest``, attached over this connection, holds the bytes of its arenas'
        ``checksums`` (its manifest's, in order): it is served to every client from now on. True if that cleared the flag.
        """
        return bool(self.request({"op": "verified", "digest": digest, "checksums": checksums})[0].get("cleared"))

    def drop_corrupt(self, digest: str, force: bool = False) -> tuple[int, ...] | None:
        """Evict entry ``digest``, found corrupt, unless engines have it attached (``force``: even then).

        None: it is gone (evicted now, or already); else the pids of the engines that keep it attached, and it stays.
        """
        try:
            self.evict(digest, force=force)
        except ServerError as exc:
            if exc.code == "not_found":
                return None  # evicted meanwhile: gone all the same
            if exc.code != "attached":
                raise
            held = ServerStatus.from_json(self.status()).held([digest])
            return held[digest].attached_pids if held else None
        return None

    def status(self) -> dict:
        return self.request({"op": "status"})[0]

    def locate(self, fingerprint: Fingerprint) -> list[dict]:
        """The other entries of the node that hold ``fingerprint``'s content (rows: ``fingerprint``, ``tier``, ``bytes``)."""
        sources = self.request({"op": "locate", "fingerprint": fingerprint.to_json()})[0].get("sources")
        if not isinstance(sources, list):
            raise ProtocolError(
                "the server's locate reply has no list of sources; run the same weightcache version on both sides"
            )
        return sources

    def versions(self, lineage: str) -> "list[HeldVersion]":
        """The versions of ``lineage`` (``Fingerprint.lineage``) the server holds, oldest first."""
        rows = self.request({"op": "versions", "lineage": lineage})[0].get("versions")
        try:
            if not isinstance(rows, list):
                raise TypeError("no list of versions")
            return [HeldVersion.from_json(row) for row in rows]
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(
                f"the server's versions reply is malformed ({exc!s:.120}); run the same weightcache version on both sides"
            ) from None

    def evict(self, digest_prefix: str, force: bool = False) -> list[str]:
        return self.request({"op": "evict", "digest": digest_prefix, "force": force})[0]["evicted"]

    def put_artifact(self, digest: str, key: str, fd: int) -> dict:
        """Keep the sealed memfd ``fd`` beside entry ``digest`` under ``key`` (the server duplicates it; the caller keeps its own).

        Returns the reply (``bytes``, ``replaced``); ServerError with code ``not_found``, ``too_large``,
        ``too_many``, ``over_budget`` or ``bad_request`` says why it was not kept.
        """
        return self.request({"op": "put_artifact", "digest": digest, "key": key}, [fd])[0]

    def get_artifact(self, digest: str, key: str) -> tuple[int, int] | None:
        """``(fd, size)`` of entry ``digest``'s artifact ``key`` (the caller closes the fd), or None when there is none."""
        try:
            reply, fds = self.request({"op": "get_artifact", "digest": digest, "key": key})
        except ServerError as exc:
            if exc.code == "not_found":
                return None
            raise
        if len(fds) != 1 or not isinstance(reply.get("bytes"), int):
            close_fds(fds)
            raise ProtocolError(
                f"the server's get_artifact reply carried {len(fds)} fds; run the same weightcache version on both sides"
            )
        return fds[0], reply["bytes"]

    def report_fallback(self, kind: str) -> None:
        """Tell the server this process loaded from disk instead of attaching (``kind``: metrics.FALLBACK_KINDS)."""
        self.request({"op": "report", "fallback": kind})

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _connect(path: Path, timeout: float) -> socket.socket:
    """A socket connected to ``path``; retried with a short backoff while the server's listen queue is full."""
    deadline = time.monotonic() + timeout
    delay, longest = _CONNECT_BACKOFF_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + delay >= deadline:
                raise ServerUnavailable(str(path), f"its listen queue stayed full for {timeout:g} s") from None
            time.sleep(delay)
            delay = min(delay * 2, longest)
        except FileNotFoundError:
            sock.close()
            raise ServerUnavailable(str(path), "no socket") from None
        except ConnectionRefusedError:
            sock.close()
            raise ServerUnavailable(str(path), "socket exists but nobody listens: the server died") from None
        except PermissionError:
            sock.close()
            raise AccessDenied(
                f"permission denied on {path}: the server belongs to another user; "
                "run the engine as the server's user or use your own --socket-dir"
            ) from None
        except OSError as exc:
            sock.close()
            raise ServerUnavailable(str(path), str(exc)) from None


def wait_for_server(socket_dir: SocketDirLike = None, timeout: float = 10.0) -> None:
    """Block until a server answers ``hello`` on ``socket_dir``; ServerUnavailable after ``timeout``."""
    socket_dir = SocketDir.parse(socket_dir)
    deadline = time.monotonic() + timeout
    last: ServerUnavailable | None = None
    while time.monotonic() < deadline:
        try:
            with Connection(socket_dir, timeout=2.0) as conn:
                conn.hello()
                return
        except ServerUnavailable as exc:
            last = exc
            time.sleep(0.05)
    raise ServerUnavailable(str(socket_dir.socket), f"not ready after {timeout:.0f} s ({last.reason if last else '?'})")


def server_is_running(socket_dir: SocketDirLike = None) -> bool:
    """Whether a server answers on ``socket_dir``."""
    try:
        with Connection(socket_dir, timeout=2.0) as conn:
            conn.hello()
        return True
    except (ServerUnavailable, AccessDenied):
        return False
