"""An entry's metadata in one sealed memfd: what a successor or systemd's fd store keeps besides the entry's fds.

The record holds what a publish frame carries besides its fds (fingerprint and
the manifest's JSON part) plus the label, the publisher, the age and whether the
entry is verified (a successor keeps an unverified entry unverified; the fd store's
entries come back unverified whatever their record says). Whoever
reads it back admits the entry with the publish check (``core/server/admission.py``):
the record is never trusted further than a publish would be.
"""

from __future__ import annotations

import json

from weightcache.core.memfd import read_memfd, sealed_memfd, sealed_size
from weightcache.core.server.registry import Entry
from weightcache.core.wire.protocol import encode

MAX_RECORD_BYTES = 64 << 20
"""The largest record read back (a manifest's JSON part is bounded by the frame limit, far below this)."""


def sealed_record(entry: Entry) -> int:
    """A sealed memfd holding ``entry``'s record; the caller closes it."""
    record = {
        "fingerprint": entry.fingerprint.to_json(),
        "manifest": entry.manifest,
        "label": entry.label,
        "published_by": entry.published_by,
        "created": entry.created,
        "verified": entry.verified,
    }
    return sealed_memfd(encode(record), "weightcache-entry-record")


def read_record(fd: int) -> dict:
    """The record in the sealed memfd ``fd`` (ValueError if it is not one, too large, or not a JSON object)."""
    size = sealed_size(fd, "the entry's record")
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"the entry's record is {size} bytes, more than the {MAX_RECORD_BYTES} a server reads")
    record = json.loads(read_memfd(fd, size))
    if not isinstance(record, dict):
        raise ValueError("the entry's record is not a JSON object")
    return record
