"""The server's JSON replies decoded into typed values, in one place: past here nobody indexes a reply by string.

``Connection``'s methods hand back the reply as the server sent it (outside code and ``weightcache status --json``
read that); the core decodes what it uses with these. A reply that lacks a field or holds the wrong kind of value
raises ProtocolError naming the field; a field an older server does not send has the default that server meant.
"""

from __future__ import annotations

import typing

import attrs

from weightcache.core.errors import ProtocolError

_SAME_VERSION = "run the same weightcache version on both sides"


_REQUIRED = object()


def _field(reply: typing.Mapping, op: str, name: str, kind: type, default: typing.Any = _REQUIRED) -> typing.Any:
    """``reply[name]`` checked to be a ``kind`` (a bool is no int here); ``default`` where an older server leaves it out."""
    if name not in reply and default is not _REQUIRED:
        return default
    value = reply.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"the server's {op} reply holds {value!r:.60} as {name}; {_SAME_VERSION}")
    return value


@attrs.frozen
class PublishReply:
    """What the server says to a publish: the entry's digest, and whether this publish created it (False: held already)."""

    digest: str
    created: bool

    @classmethod
    def from_json(cls, reply: typing.Mapping) -> "PublishReply":
        return cls(_field(reply, "publish", "digest", str), _field(reply, "publish", "created", bool))


@attrs.frozen
class HeldEntry:
    """One row of a status reply, as far as the core reads it: digest, label, bytes, tier, the pids attached to it."""

    digest: str
    label: str
    nbytes: int
    tier: str
    attached_pids: tuple[int, ...]

    @classmethod
    def from_json(cls, row: object) -> "HeldEntry":
        if not isinstance(row, dict):
            raise ProtocolError(f"the server's status reply holds a row that is not an object; {_SAME_VERSION}")
        pids = _field(row, "status", "attached_pids", list, default=[])
        return cls(
            digest=_field(row, "status", "digest", str),
            label=_field(row, "status", "label", str, default=""),
            nbytes=_field(row, "status", "bytes", int),
            tier=_field(row, "status", "tier", str, default=""),
            attached_pids=tuple(pid for pid in pids if isinstance(pid, int)),
        )


@attrs.frozen
class ServerStatus:
    """A status reply as the core reads it: the entries and the byte budgets (``total``, ``host``, ``per_gpu``)."""

    entries: tuple[HeldEntry, ...]
    budgets: typing.Mapping[str, int | None]

    @classmethod
    def from_json(cls, reply: typing.Mapping) -> "ServerStatus":
        rows = _field(reply, "status", "entries", list)
        budgets = reply.get("budgets")
        if not isinstance(budgets, dict):  # an older server: one budget for every tier
            budgets = {"total": reply.get("byte_budget")}
        shown = {key: value if isinstance(value, int) and not isinstance(value, bool) else None for key, value in budgets.items()}
        return cls(tuple(HeldEntry.from_json(row) for row in rows), shown)

    def held(self, digests: typing.Collection[str]) -> dict[str, HeldEntry]:
        """The entries among ``digests`` the server holds, by digest."""
        return {entry.digest: entry for entry in self.entries if entry.digest in digests}
