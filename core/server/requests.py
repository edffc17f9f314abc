"""The server's requests, one method per op: publish, attach, verified, locate, versions, detach, status, report,
evict and the artifacts'. Each answers ``(reply, fds)``; a handler that raises has kept none of the fds it was given.
"""

from __future__ import annotations

import logging
import os
import typing

from weightcache.core import PROTOCOL_VERSION, __version__
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.memfd import sealed_size
from weightcache.core.server.admission import REPLY_ENVELOPE_BYTES, admit_publish
from weightcache.core.server.connections import OUT_OF_RESOURCES, SHED_WHEN_OUT_OF_FDS, ConnectionTable
from weightcache.core.server.metrics import Metrics
from weightcache.core.server.registry import MAX_ARTIFACT_KEY_CHARS, OverBudget, Registry, TooManyArtifacts, VersionConflict
from weightcache.core.server.rewarm import Warmer
from weightcache.core.wire.protocol import MAX_SOURCES, close_fds, error_reply, ok_reply

if typing.TYPE_CHECKING:
    from weightcache.core.server.server import ServerConfig

log = logging.getLogger(__name__)

_OPS_WITH_FDS = frozenset({"publish", "put_artifact"})
_OPS_THAT_CHANGE_ENTRIES = frozenset({"publish", "evict", "put_artifact"})
_DIGEST_CHARS = frozenset("0123456789abcdef")


class Requests:
    """The request handlers of ``Server`` (a mixin: the state they read is the server's)."""

    config: ServerConfig
    metrics: Metrics
    registry: Registry
    warmer: Warmer | None
    _table: ConnectionTable
    _frozen: typing.Any  # threading.Event

    metrics_snapshot: typing.Callable[[list[dict] | None], dict]

    def _dispatch(self, message: dict, fds: list[int], connection_id: int, pid: int) -> tuple[dict, list[int]]:
        op = message.get("op")
        handlers = {
            "hello": self._hello,
            "publish": self._publish,
            "attach": self._attach,
            "detach": self._detach,
            "status": self._status,
            "evict": self._evict,
            "put_artifact": self._put_artifact,
            "get_artifact": self._get_artifact,
            "locate": self._locate,
            "versions": self._versions,
            "report": self._report,
            "verified": self._verified,
        }
        handler = handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return _refused(fds, "bad_request", f"unknown op {op!r:.80}; expected one of {', '.join(handlers)}")
        if self._frozen.is_set() and op in _OPS_THAT_CHANGE_ENTRIES:
            return _refused(
                fds, "busy", "the server is handing its entries to a successor; try again in a second", retry_after_s=0.05
            )
        if op not in _OPS_WITH_FDS and fds:
            return _refused(fds, "bad_request", f"op {op!r} takes no fds; {len(fds)} were closed")
        # A handler that raises has kept none of the fds (publish hands them over only on success).
        try:
            return self._handle(handler, message, fds, connection_id, pid)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            return _refused(fds, "bad_request", f"malformed {op} request: {exc!s:.300}")
        except OSError as exc:
            close_fds(fds)
            if exc.errno not in OUT_OF_RESOURCES:
                raise
            log.warning("could not answer %s: %s", op, exc.strerror or exc)
            return error_reply("busy", f"the server is out of file descriptors or memory ({exc.strerror}); try again shortly"), []
        except BaseException:
            close_fds(fds)
            raise

    def _handle(self, handler, message, fds, connection_id, pid):
        """Run ``handler``; out of fds (an attach duplicates its entry's), shed idle connections and try once more.

        Only requests that brought no fds are tried again: a handler that raised has closed none of its own.
        """
        try:
            return handler(message, fds, connection_id, pid)
        except OSError as exc:
            if fds or exc.errno not in OUT_OF_RESOURCES:
                raise
            if not self._table.shed_idle(SHED_WHEN_OUT_OF_FDS, "to free file descriptors"):
                raise
        return handler(message, fds, connection_id, pid)

    def _hello(self, message, fds, connection_id, pid):
        return ok_reply(version=__version__, protocol=PROTOCOL_VERSION, pid=os.getpid(), uid=os.geteuid()), []

    def _publish(self, message, fds, connection_id, pid):
        try:
            entry = admit_publish(message, fds, pid, self.config.max_frame_bytes)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OSError) as exc:
            return _refused(fds, "bad_request", f"malformed publish request: {exc!s:.600}")
        try:
            created = self.registry.publish(entry, requester=pid)
        except OverBudget as exc:
            return _refused(fds, "over_budget", str(exc))
        except VersionConflict as exc:
            return _refused(fds, "version_conflict", str(exc))
        return ok_reply(digest=entry.digest, created=created), []

    def _attach(self, message, fds, connection_id, pid):
        # A client that "verifies" checksums an unverified entry's arenas before use and says so (`verified`);
        # any other client misses such an entry and loads from disk.
        verifies = message.get("verifies") is True
        if "fingerprint" not in message:  # by full digest: a scrub (`weightcache verify`) that knows entries from status
            digest = _full_digest(message["digest"])
            found = self.registry.checkout(digest, connection_id, pid, verifies)
            if found is None:
                held = self.registry.is_unverified(digest)
                text = (
                    _unverified_text(f"entry {digest[:12]}")
                    if held
                    else f"no entry {digest[:12]}; `weightcache status` lists them"
                )
                return error_reply("not_found", text), []
            entry, fds = found
            reply = ok_reply(digest=entry.digest, manifest=entry.manifest, label=entry.label, verify=not entry.verified)
            return {**reply, "fingerprint": entry.fingerprint.to_json()}, fds
        fingerprint = Fingerprint.from_json(message["fingerprint"])
        found = self.registry.checkout(fingerprint.digest, connection_id, pid, verifies)
        if found is None:
            if self.registry.is_unverified(fingerprint.digest):
                return error_reply(
                    "not_found",
                    _unverified_text(f"entry {fingerprint.short}"),
                    digest=fingerprint.digest,
                    fields=[],
                    unverified=True,
                ), []
            closest, fields = self.registry.closest(fingerprint)
            return error_reply(
                "not_found",
                f"no entry for fingerprint {fingerprint.short}",
                digest=fingerprint.digest,
                closest=closest,
                fields=list(fields),
            ), []
        entry, fds = found
        return ok_reply(digest=entry.digest, manifest=entry.manifest, label=entry.label, verify=not entry.verified), fds

    def _verified(self, message, fds, connection_id, pid):
        """A client that attached an unverified entry over this connection found its ``checksums`` in its bytes."""
        digest = _full_digest(message["digest"])
        checksums = message["checksums"]
        if not isinstance(checksums, list):
            raise TypeError("checksums must be a list, one per arena")
        try:
            cleared = self.registry.mark_verified(digest, connection_id, checksums)
        except KeyError as exc:
            return error_reply("not_found", exc.args[0]), []
        except PermissionError as exc:
            return error_reply("bad_request", str(exc)), []
        return ok_reply(digest=digest, cleared=cleared), []

    def _locate(self, message, fds, connection_id, pid):
        """Where else the node holds this fingerprint's content (the loader copies from there; the server copies nothing)."""
        fingerprint = Fingerprint.from_json(message["fingerprint"])
        return ok_reply(sources=self.registry.locate(fingerprint)[:MAX_SOURCES]), []

    def _versions(self, message, fds, connection_id, pid):
        """The entries of one lineage, oldest version first (an engine picks the version to switch to; refit)."""
        lineage = message["lineage"]
        if not isinstance(lineage, str) or len(lineage) != 64:
            raise ValueError("lineage must be a full digest (64 hex digits)")
        return ok_reply(versions=self.registry.versions(lineage)[-MAX_SOURCES:]), []

    def _detach(self, message, fds, connection_id, pid):
        self.registry.detach(str(message["digest"]), connection_id)
        return ok_reply(), []

    def _status(self, message, fds, connection_id, pid):
        # Rows are bounded (labels and shown texts are short); this bounds their count too, so the reply fits a frame.
        entries, omitted = self.registry.status(max_bytes=self.config.max_frame_bytes - REPLY_ENVELOPE_BYTES)
        return ok_reply(
            entries=entries,
            omitted=omitted,
            held_bytes=self.registry.held_bytes(),
            byte_budget=self.config.byte_budget,
            tiers=self.registry.tiers(),
            budgets=self.registry.budgets.to_json(),
            pid=os.getpid(),
            version=__version__,
            warm=self.warmer.progress() if self.warmer is not None else [],
            metrics=self.metrics_snapshot(entries),
        ), []

    def _report(self, message, fds, connection_id, pid):
        """A client's report that it loaded from disk (``kind``: one of metrics.FALLBACK_KINDS); counted, never refused."""
        kind = self.metrics.fell_back(str(message.get("fallback", "other"))[:40])
        log.info("pid %d loaded from disk instead of attaching (%s)", pid, kind, extra={"peer_pid": pid, "reason": kind})
        return ok_reply(counted=kind), []

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

    def _put_artifact(self, message, fds, connection_id, pid):
        try:
            digest, key = _artifact_address(message)
            if len(fds) != 1:
                raise ValueError(f"put_artifact carries exactly one fd (a sealed memfd holding the artifact), not {len(fds)}")
            nbytes = sealed_size(fds[0], "the artifact")
            if nbytes == 0:
                raise ValueError("the artifact memfd is empty")
        except (KeyError, TypeError, ValueError, OSError) as exc:
            return _refused(fds, "bad_request", f"malformed put_artifact request: {exc!s:.600}")
        if nbytes > self.config.max_artifact_bytes:
            return _refused(
                fds,
                "too_large",
                f"an artifact of {nbytes} bytes exceeds the {self.config.max_artifact_bytes} bytes the server keeps "
                "per artifact; keep it elsewhere (the engine compiles again on restart)",
            )
        try:
            replaced = self.registry.put_artifact(digest, key, fds[0], nbytes, self.config.max_artifacts_per_entry)
        except KeyError as exc:
            return _refused(fds, "not_found", exc.args[0])
        except TooManyArtifacts as exc:
            return _refused(fds, "too_many", str(exc))
        except OverBudget as exc:
            return _refused(fds, "over_budget", str(exc))
        return ok_reply(digest=digest, key=key, bytes=nbytes, replaced=replaced), []

    def _get_artifact(self, message, fds, connection_id, pid):
        digest, key = _artifact_address(message)
        found = self.registry.checkout_artifact(digest, key)
        if found is None:
            return error_reply("not_found", f"entry {digest[:12]} holds no artifact {key!r:.80} (or there is no such entry)"), []
        fd, nbytes = found
        return ok_reply(digest=digest, key=key, bytes=nbytes), [fd]


def _refused(fds: list[int], code: str, text: str, **fields: typing.Any) -> tuple[dict, list[int]]:
    """The error reply ``code`` to a request that keeps none of its ``fds``: they are closed first."""
    close_fds(fds)
    return error_reply(code, text, **fields), []


def _full_digest(digest) -> str:
    """``digest`` if it is an entry's full digest (64 lower-case hex characters); ValueError otherwise."""
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _DIGEST_CHARS:
        raise ValueError(f"digest must be an entry's full digest (64 lower-case hex characters), not {digest!r:.80}")
    return digest


def _artifact_address(message: dict) -> tuple[str, str]:
    """The entry digest and the artifact key of a put_artifact or get_artifact request (ValueError if malformed)."""
    digest, key = _full_digest(message["digest"]), message["key"]
    if not isinstance(key, str) or not 0 < len(key) <= MAX_ARTIFACT_KEY_CHARS or not key.isprintable():
        raise ValueError(f"key must be a printable string of 1 to {MAX_ARTIFACT_KEY_CHARS} characters, not {key!r:.80}")
    return digest, key


def _unverified_text(name: str) -> str:
    """Why an attach of ``name`` (an entry the server holds but nobody has verified since it came back) missed."""
    return (
        f"{name} is held but not verified since the server came back; it is served only to clients that "
        "checksum it (weightcache's own, this version) until one of them or `weightcache verify` has"
    )
