"""What a server checks before it keeps an entry: a publish's fds against its manifest, whoever sends them.

One check for every way an entry arrives: an engine's publish and a predecessor's
handover (``core/server/handover.py``) go through ``admit_publish`` alike.
"""

from __future__ import annotations

import resource

from weightcache.core.arena.base import ArenaSpec, plausible_size
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.layout.tensor_table import MAX_TABLE_BYTES
from weightcache.core.memfd import read_memfd, sealed_size
from weightcache.core.server.registry import Entry, tier_of
from weightcache.core.wire.protocol import encode

REPLY_ENVELOPE_BYTES = 4096
"""A reply's fields besides its rows (status) or its manifest (attach)."""


def admit_publish(message: dict, fds: list[int], pid: int, max_frame_bytes: int) -> Entry:
    """The entry a publish ``message`` with ``fds`` (arena fds, then the tensor table's sealed memfd) describes, checked.

    The entry owns ``fds`` once returned; on any error (KeyError, TypeError, ValueError,
    AttributeError, RecursionError, OSError) the caller still owns them and closes them.
    """
    fingerprint = Fingerprint.from_json(message["fingerprint"])
    if not fds:
        raise ValueError("a publish carries one fd per arena and then the tensor table's sealed memfd; none came")
    *arena_fds, table_fd = fds
    table_bytes = sealed_size(table_fd, "the tensor table")
    if table_bytes > MAX_TABLE_BYTES:
        raise ValueError(
            f"the tensor table is {table_bytes} bytes, more than the {MAX_TABLE_BYTES} a server reads; split the model"
        )
    manifest = Manifest.from_wire(message["manifest"], read_memfd(table_fd, table_bytes))
    if len(arena_fds) != len(manifest.arenas):
        raise ValueError(f"manifest lists {len(manifest.arenas)} arenas but {len(arena_fds)} arena fds came")
    counted = [
        check_arena_fd(fd, spec, extent, index)
        for index, (fd, spec, extent) in enumerate(zip(arena_fds, manifest.arenas, manifest.arena_extents(), strict=True))
    ]
    tier_bytes: dict[str, int] = {}
    for spec, nbytes in zip(manifest.arenas, counted, strict=True):
        tier = tier_of(spec.backend, spec.device)
        tier_bytes[tier] = tier_bytes.get(tier, 0) + nbytes
    entry = Entry(
        fingerprint=fingerprint,
        manifest=message["manifest"],
        fds=arena_fds,
        nbytes=sum(counted),
        label=message.get("label", ""),
        published_by=pid,
        tier_bytes=tier_bytes,
        table_fd=table_fd,
        tensors=len(manifest.tensors),
        table_bytes=table_bytes,
    )
    del manifest  # the records were checked; the table's bytes stay in its memfd only
    reply_bytes = len(encode(entry.manifest)) + REPLY_ENVELOPE_BYTES  # escaped, it may outgrow the frame it came in
    if reply_bytes > max_frame_bytes:
        raise ValueError(f"the manifest would need a {reply_bytes}-byte attach reply, past the frame limit; split the model")
    return entry


def check_arena_fd(fd: int, spec: ArenaSpec, extent: int, index: int) -> int:
    """Check arena ``index``'s fd against its spec and its tensors' ``extent``; the bytes it counts against the budget.

    A host arena must be a memfd sealed against writes, shrinking and growing,
    as large as its spec says (up to one page more): the seals make the bytes
    immutable for every engine, and its real size is what it counts.  A CUDA
    arena's fd cannot be sized without CUDA, so its declared size counts and
    must be plausible (``plausible_size``: its tensors' extent rounded up to 2 MiB, plus
    2 MiB; the manifest already checked it is at least that extent).  Every arena carries
    a checksum of its bytes, which the server keeps and hands out but never computes:
    whatever moves the bytes checks them (docs/architecture.md, "Checksums").
    """
    if spec.backend not in ("host", "cuda"):
        raise ValueError(f"unknown arena backend {spec.backend!r:.40}; expected 'host' or 'cuda'")
    if spec.checksum is None:
        raise ValueError(
            f"arena {index} carries no checksum of its bytes; publish through weightcache's own publish "
            "(publish.publish_arenas computes it) with the server's weightcache version"
        )
    if spec.backend == "cuda":
        bound = plausible_size(extent)
        if spec.size > bound:
            raise ValueError(
                f"cuda arena {index} declares {spec.size} bytes but its tensors reach only {extent}; "
                f"an arena may exceed its tensors by its allocation granularity only (at most {bound} bytes here); "
                "export into arenas sized for the tensors they hold"
            )
        return spec.size
    size = sealed_size(fd, f"host arena {index}")
    if size < spec.size:
        raise ValueError(f"host arena {index} fd is {size} bytes, manifest says {spec.size}")
    if size > spec.size + resource.getpagesize():
        raise ValueError(
            f"host arena {index} memfd is {size} bytes but its manifest declares {spec.size}; declare the memfd's real size"
        )
    return size
