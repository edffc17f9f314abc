"""systemd's file-descriptor store: every entry's fds kept by the service manager, so a crash of the server loses none.

When ``$NOTIFY_SOCKET`` is set (a unit with ``FileDescriptorStoreMax=`` and ``NotifyAccess=main``),
the server sends, for each entry it publishes, one ``FDSTORE=1`` datagram per fd (sd_notify's
protocol: an AF_UNIX datagram of ``KEY=VALUE`` lines, the fd as SCM_RIGHTS), named
``wc.<digest>.<index>``: index 0 is the entry's record (``core/server/entry_record.py``: fingerprint,
manifest's JSON part, label, publisher, age), 1 its tensor table, 2 onwards its arenas. One fd per
name keeps the order whatever order systemd hands them back in. An eviction sends
``FDSTOREREMOVE=1`` for each name. A clean stop removes nothing: systemd keeps the store across a
restart of the unit.

On start, ``adopt`` takes the fds systemd passes (``$LISTEN_FDS`` from fd 3, ``$LISTEN_FDNAMES``),
puts each entry back together and admits it with the publish check, marked not verified: it is served
only to clients that checksum it before use, until one of them or the scrub says it matched
.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import typing

from weightcache.core.progress import counted
from weightcache.core.server.admission import admit_publish
from weightcache.core.server.entry_record import read_record, sealed_record
from weightcache.core.server.registry import Entry, OverBudget, Registry
from weightcache.core.wire.protocol import close_fds

log = logging.getLogger(__name__)

NAME_PREFIX = "wc."
LISTEN_FDS_START = 3


def _name(digest: str, index: int) -> str:
    return f"{NAME_PREFIX}{digest}.{index}"


class FdStore:
    """The service manager's fd store, reached through ``$NOTIFY_SOCKET``."""

    def __init__(self, address: str):
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.kept: dict[str, int] = {}  # digest -> fds this server put in the store (the ``fdstore_fds`` gauge)
        self.failures = 0  # entries it could not keep or remove (a full store)

    @classmethod
    def from_environ(cls) -> FdStore | None:
        """The store named by ``$NOTIFY_SOCKET``, or None outside systemd."""
        address = os.environ.get("NOTIFY_SOCKET")
        return cls(address) if address else None

    def notify(self, text: str, fds: typing.Sequence[int] = ()) -> None:
        """Send one sd_notify datagram (OSError if the service manager is gone)."""
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self._sock.sendmsg([text.encode()], ancillary, 0, self.address)

    def keep(self, entry: Entry) -> None:
        """Store ``entry``'s metadata, table and arena fds; a failure is logged (the entry is served either way)."""
        meta = sealed_record(entry)
        try:
            self.notify(f"FDSTOREREMOVE=1\nFDNAME={_name(entry.digest, 0)}")  # a predecessor's metadata of the same entry
            for index, fd in enumerate([meta, entry.table_fd, *entry.fds]):
                self.notify(f"FDSTORE=1\nFDNAME={_name(entry.digest, index)}", [fd])
                self.kept[entry.digest] = index + 1
        except OSError as exc:
            self.failures += 1
            log.warning(
                "could not keep %s in systemd's fd store (%s); raise FileDescriptorStoreMax= in the unit",
                entry.digest[:12],
                exc,
            )
        finally:
            os.close(meta)

    def note(self, entry: Entry) -> None:
        """Count ``entry``'s fds as kept without sending them: a predecessor kept them under the same names (a
        successor is not the unit's main process until the handover is done, and systemd would refuse them)."""
        self.kept[entry.digest] = 2 + len(entry.fds)

    def forget(self, entry: Entry) -> None:
        """Remove an evicted entry's fds from the store."""
        try:
            for index in range(2 + len(entry.fds)):
                self.notify(f"FDSTOREREMOVE=1\nFDNAME={_name(entry.digest, index)}")
            self.kept.pop(entry.digest, None)
        except OSError as exc:
            self.failures += 1
            log.warning("could not remove %s from systemd's fd store: %s", entry.digest[:12], exc)

    def close(self) -> None:
        self._sock.close()


def passed_fds() -> dict[str, int]:
    """The fds systemd passed this process (``$LISTEN_FDS``, ``$LISTEN_FDNAMES``) by name; none if they are not ours."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return {}
    count = int(os.environ.get("LISTEN_FDS") or 0)
    names = (os.environ.get("LISTEN_FDNAMES") or "").split(":")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)  # not for our children
    fds = {}
    for offset in range(count):
        fd = LISTEN_FDS_START + offset
        os.set_inheritable(fd, False)
        name = names[offset] if offset < len(names) else ""
        if name.startswith(NAME_PREFIX):
            fds[name] = fd
        else:
            log.warning("closing fd %d passed by systemd under the name %r: not a weightcache entry's", fd, name)
            os.close(fd)
    return fds


def adopt(registry: Registry, fds: dict[str, int], max_frame_bytes: int) -> int:
    """Admit every entry whose fds systemd passed into ``registry``; how many were admitted.

    An entry that is incomplete or fails the publish check is logged and its fds closed; the rest are
    admitted not verified (``Entry.verified``).
    """
    groups: dict[str, dict[int, int]] = {}
    for name, fd in fds.items():
        digest, _, index = name[len(NAME_PREFIX) :].rpartition(".")
        groups.setdefault(digest, {})[int(index) if index.isdigit() else -1] = fd
    adopted = 0
    for digest, parts in groups.items():
        ordered = [parts.get(i, -1) for i in range(len(parts))]
        meta_fd = parts.pop(0, -1)
        try:
            if -1 in ordered or len(ordered) < 3:
                raise ValueError(f"{len(parts)} fds came under its name, not a complete entry")
            meta = read_record(meta_fd)
            entry = admit_publish(meta, [*ordered[2:], ordered[1]], int(meta["published_by"]), max_frame_bytes)
            if entry.digest != digest:
                raise ValueError(f"its metadata names entry {entry.digest[:12]}")
            entry.created = float(meta["created"])
            entry.verified = False  # nobody has checked these bytes since the crash
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OSError) as exc:
            close_fds(parts.values())
            log.warning("not re-serving entry %s from systemd's fd store: %s", digest[:12], exc)
            continue
        finally:
            close_fds([meta_fd])
        try:
            adopted += registry.publish(entry, evict=False)
        except OverBudget as exc:
            entry.close_fds()
            log.warning("not re-serving entry %s from systemd's fd store: %s", digest[:12], exc)
    if groups:
        log.info(
            "re-serving %d of %s kept in systemd's fd store, to clients that verify them until they are checked",
            adopted,
            counted(len(groups), "entry"),
        )
    return adopted
