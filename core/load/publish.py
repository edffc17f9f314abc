"""The one publish sequence: seal a builder's arenas, checksum them, publish them with their manifest in one frame.

The loader, the node's fills and seeding, the Python API and the engine adapters all end here.
"""

from __future__ import annotations

import gc
import time

import attrs

from weightcache.core.client.client import Connection
from weightcache.core.client.replies import PublishReply
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.load.export import ArenaBuilder
from weightcache.core.socket_dir import SocketDirLike
from weightcache.core.wire.protocol import close_fds


def publish_arenas(
    builder: ArenaBuilder,
    fingerprint: Fingerprint,
    manifest: Manifest,
    socket_dir: SocketDirLike = None,
    label: str = "",
    copied_from: str | None = None,
    timings: dict | None = None,
) -> PublishReply:
    """Seal ``builder``'s arenas, checksum them, and publish them with ``manifest`` in one frame; returns the server's reply.

    The one publish sequence: the loader above, the Python API and the engine adapters all end here.
    An empty ``label`` becomes the fingerprint's architecture and adapter, so every entry has one.
    ``manifest.arenas`` are replaced by the sealed arenas' specs, each with the checksum of its
    bytes. With ``copied_from`` (the bytes came from there: a peer node, a GPU entry), each
    declared arena of ``manifest`` must carry the same size and checksum as the bytes that
    arrived, else ChecksumMismatch and nothing is published. ``timings`` (a benchmark's) gets ``seal_s`` (sealing and
    checksumming the arenas here) and ``request_s`` (the publish request: the server decodes, checks and stores it).
    """
    label = label or f"{fingerprint.architecture} ({fingerprint.adapter})"
    start = time.perf_counter()
    seal(builder)
    if copied_from is not None:
        specs = builder.check_copy(manifest.arenas, copied_from)
    else:
        specs = builder.specs()
    manifest = attrs.evolve(manifest, arenas=specs)
    fds = [arena.export_fd() for arena in builder.arenas]
    sealed = time.perf_counter()
    try:
        with Connection(socket_dir) as connection:
            reply = PublishReply.from_json(connection.publish(fingerprint, manifest, fds, label=label))
    finally:
        close_fds(fds)
    if timings is not None:
        timings.update(seal_s=sealed - start, request_s=time.perf_counter() - sealed)
    return reply


def seal(builder: ArenaBuilder) -> None:
    """Seal the arenas; a reference cycle may still hold a view, so collect once and retry."""
    try:
        builder.seal()
    except OSError:
        gc.collect()
        builder.seal()
