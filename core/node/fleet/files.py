"""A checkpoint this node has never hashed, known from the fleet's records of its weight files (issue 52).

A node whose digest store knows a weight file's content digest (it hashed the file, or
read it in a disk load) writes ``files/<identity>`` after it publishes (``published``): the digest, keyed
by what any node sees of the file without reading its weights (``FileSeen``: size,
modification and change times, inode, the sha256 of its safetensors header). A node that
sees a file for the first time reads its header (its only read of the checkpoint), stats
it and looks that identity up; with a valid record for every file it knows the
fingerprint, so it pulls the entry (checked against the content record, as every pull)
instead of reading storage. A file changed after its record was made has another
identity, since every write and every ``utime`` moves its change time: a miss, and the
node reads the file itself (docs/decisions.md, "A node that has never hashed a checkpoint"). The config files the
adapter declares beside the weights (``config.json``) have no records: each node hashes them itself.

Several nodes seeing a new checkpoint at once: the first claims its first read
(``sightings/<name>``, under a lease it renews) and reads the disk; the others wait for
the records of its files, then pull. Once it has published, the reader claims the
content's disk read under the same lease (so the others wait for its sharing agent
rather than read), writes the records, and lets go once its agent lists the entry.
A node that learned digests remembers them in its own store (their identity is the one
the records name, as the store's own key requires); a disk load that reads other bytes
replaces them. ``published`` is called after every publish of a checkpoint, whatever its
bytes came from; it is a no-op without a fleet.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import typing
from pathlib import Path

import attrs

from weightcache.core.errors import FleetUnavailable, WeightCacheError
from weightcache.core.fingerprint import Fingerprint, sha256_json
from weightcache.core.identity.declared import CheckpointFiles
from weightcache.core.identity.digests import checkpoint_digests, default_store
from weightcache.core.identity.safetensors_io import Header, Sighting, identity_of, read_header
from weightcache.core.node.fleet.config import SHARED_WAIT_S, FleetConfig
from weightcache.core.node.fleet.records import FileContent, FileSeen
from weightcache.core.node.fleet.registry import FleetRegistry, renew_lease
from weightcache.core.progress import counted

log = logging.getLogger(__name__)

POLL_S: typing.Final = 0.25
"""How often a node waiting for another node's first read looks for the records of its files."""
FILE_RECORD_TTL_S: typing.Final = 7 * 24 * 3600
"""How long a file's record lives unless a node that hashed the file writes it again (any disk load of it does)."""


def seen_of(header: Header) -> FileSeen:
    """What a node sees of the file ``header`` was read from, without reading its weights."""
    key = header.key
    if key is None:
        raise ValueError(f"the header of {header.file} was read without the file's version")
    return FileSeen(key.st_size, key.st_mtime_ns, key.st_ctime_ns, key.st_ino, hashlib.sha256(header.raw).hexdigest())


def sighting_name(path: Path, headers: typing.Sequence[Header]) -> str:
    """The name of a first read of the checkpoint at ``path``: its files' names and identities."""
    single = path.is_file()
    return sha256_json([[h.file.name if single else str(h.file.relative_to(path)), seen_of(h).name] for h in headers])


@attrs.define
class _Held:
    """A sighting claim this process holds: its registry, the lease it lives under and the thread that renews it."""

    registry: FleetRegistry
    lease: int
    stop: threading.Event = attrs.field(factory=threading.Event)

    def release(self) -> None:
        self.stop.set()
        try:
            self.registry.store.revoke(self.lease)
        except FleetUnavailable as exc:  # it runs out by itself
            log.debug("weightcache: revoking a sighting claim's lease: %s", exc)


registry_away = threading.Event()
"""Set once this process found the registry away while learning a checkpoint's content (it said so: once is enough)."""
_held: dict[str, _Held] = {}
_held_lock = threading.Lock()


def fleet_config() -> FleetConfig | None:
    """The fleet the environment names; None without one, or with settings the load's own fill warns about."""
    try:
        return FleetConfig.from_env()
    except ValueError:
        return None


def learned_identity(sighting: Sighting) -> str | None:
    """The checkpoint identity of ``sighting`` from the digests this node remembers and the fleet's records of the
    rest; None without a fleet, or when a file must be read here (no record; this node claimed its first read)."""
    config = fleet_config()
    if config is None:
        return None
    try:
        digests = _learn(FleetRegistry(config), sighting)
    except FleetUnavailable as exc:
        if not registry_away.is_set():
            log.warning("weightcache: %s", exc)
        registry_away.set()
        return None
    except (WeightCacheError, OSError, ValueError) as exc:  # a header the load itself reports, or a file gone
        log.debug("weightcache: not asking the fleet what %s holds: %s", sighting.path, exc)
        return None
    return None if digests is None else identity_of(sighting.path, list(sighting.files), digests)


def _learn(registry: FleetRegistry, sighting: Sighting) -> list[str] | None:
    missing: dict[int, FileSeen] = {}
    headers = []
    weights = len(sighting.weight_files)
    for index, (file, key, digest) in enumerate(zip(sighting.files, sighting.keys, sighting.remembered[:weights], strict=False)):
        header = read_header(file)
        headers.append(header)
        if header.key != key:
            return None  # changed since it was seen: the load reads it
        if digest is None:
            missing[index] = seen_of(header)
    sighting = _configs_hashed(sighting)
    name = sighting_name(sighting.path, headers)
    lease = 0
    try:
        digests, lease = _learn_or_claim(registry, sighting, missing, name)
    finally:
        if lease and held_lease(sighting.path) != lease:
            with contextlib.suppress(FleetUnavailable):  # (else it runs out by itself)
                registry.store.revoke(lease)
    return digests


def _configs_hashed(sighting: Sighting) -> Sighting:
    """``sighting`` with the digests of its config files (``config.json``: what the adapter declares besides its
    weights) hashed here where the store has none: small files a load reads whole anyway, never in the fleet's records."""
    weights = len(sighting.weight_files)
    configs = sighting.files[weights:]
    if all(digest is not None for digest in sighting.remembered[weights:]):
        return sighting
    digests = checkpoint_digests(configs, keys=sighting.keys[weights:])
    return attrs.evolve(sighting, remembered=(*sighting.remembered[:weights], *digests))


def _learn_or_claim(
    registry: FleetRegistry, sighting: Sighting, missing: dict[int, FileSeen], name: str
) -> tuple[list[str] | None, int]:
    """The digests, once the records of ``missing`` are there; else None once this node claimed the first read (or
    must read anyway). The lease granted for the claim is returned too (0: none)."""
    deadline = time.monotonic() + registry.config.wait_s
    waiting_for, warned, lease = None, False, 0
    while True:
        digests, origins, problem = _records(registry, sighting, missing)
        if problem is not None and not warned:
            warned = True
            log.warning("weightcache: ignoring the fleet's record of a file of %s: %s", sighting.path, problem)
        if digests is not None:
            _remember(sighting, missing, digests)
            log.info(
                "weightcache: learned the content of %s of %s from the fleet's records (hashed by node %s); "
                "no weight read to know it",
                counted(len(missing), "file"),
                sighting.path,
                ", ".join(sorted(origins)),
            )
            return digests, lease
        if held_lease(sighting.path):
            return None, lease
        lease = lease or registry.store.grant(registry.config.lease_ttl_s)
        try:
            other = registry.claim_sighting(name, lease)
        except ValueError as exc:
            log.warning("weightcache: the claim on the first read of %s is not valid (%s); reading it here", sighting.path, exc)
            return None, lease
        if other is None:
            _hold(registry, lease, str(sighting.path))
            log.info("weightcache: no node of the fleet has hashed %s; this node reads it", sighting.path)
            return None, lease
        if waiting_for != other.node:
            waiting_for = other.node
            log.info("weightcache: node %s reads %s for the first time; waiting to learn its content", other.node, sighting.path)
        if time.monotonic() > deadline:
            log.warning(
                "weightcache: node %s still reads %s after %.0f s; reading it here too (WEIGHTCACHE_FLEET_WAIT_S sets the wait)",
                other.node,
                sighting.path,
                registry.config.wait_s,
            )
            return None, lease
        time.sleep(POLL_S)


def _remember(sighting: Sighting, missing: dict[int, FileSeen], digests: list[str]) -> None:
    """Remember the digests learned for ``missing`` in this node's store: their identity (change time included) is the
    one the records were made for, as the store's own key would require; a disk load that reads other bytes replaces
    them (``loader.content_digests``)."""
    store = default_store()
    for index in missing:
        store.put(sighting.keys[index], digests[index])


def _records(
    registry: FleetRegistry, sighting: Sighting, missing: dict[int, FileSeen]
) -> tuple[list[str] | None, set[str], str | None]:
    """Every file's digest (the remembered ones, and the records of ``missing``), None while a record is missing; the
    nodes that wrote the records used; and why a record was left out (not valid), if one was."""
    digests = list(sighting.remembered)
    origins: set[str] = set()
    problem: str | None = None
    for index, seen in missing.items():
        try:
            record = registry.file(seen)
        except ValueError as exc:
            record, problem = None, str(exc)[:200]
        if record is None:
            return None, origins, problem
        digests[index] = record.digest
        origins.add(record.origin)
    return typing.cast("list[str]", digests), origins, problem


def _hold(registry: FleetRegistry, lease: int, path: str) -> None:
    """Keep the sighting claim under ``lease`` until ``release`` (at most the fleet's wait: nobody waits longer)."""
    held = _Held(registry, lease)
    with _held_lock:
        _held[path] = held
    renewer = threading.Thread(
        target=renew_lease, args=(registry, lambda: held.lease, held.stop), name="weightcache-fleet-sighting", daemon=True
    )
    renewer.start()
    threading.Timer(registry.config.wait_s, held.stop.set).start()


def held_lease(model: str | os.PathLike) -> int:
    """The lease of this process's claim on the first read of ``model`` (0: none)."""
    held = _held.get(str(Path(model)))
    return held.lease if held is not None else 0


def release(model: str | os.PathLike) -> None:
    """Let go of this process's claim on the first read of ``model``, if it holds one."""
    with _held_lock:
        held = _held.pop(str(Path(model)), None)
    if held is not None:
        held.release()


def published(model: str | os.PathLike, fingerprint: Fingerprint, declared: CheckpointFiles | None = None) -> None:
    """After this node published ``fingerprint`` from the checkpoint ``model`` (whatever its bytes came from): write the
    fleet's records of the files whose digests this node's store holds; where this node claimed the checkpoint's first
    read, claim the content's disk read under that claim first (the nodes waiting to learn the content then wait for
    this node's agent instead of reading), wait (briefly) until the agent lists the entry, and let go. A no-op without
    a fleet; the registry away costs one warning (none where the load said so already). ``declared``: the files the
    adapter reads (default ``CheckpointFiles()``), whose contents the identity covers."""
    config = fleet_config()
    try:
        if config is not None:
            _published(FleetRegistry(config), model, fingerprint, declared)
    except FleetUnavailable as exc:
        if not registry_away.is_set():
            log.warning("weightcache: %s", exc)
        registry_away.set()
    except (WeightCacheError, OSError, ValueError) as exc:
        log.warning("weightcache: not writing the fleet's records of the files of %s: %s", model, str(exc)[:300])
    finally:
        release(model)


def _published(
    registry: FleetRegistry, model: str | os.PathLike, fingerprint: Fingerprint, declared: CheckpointFiles | None
) -> None:
    lease = held_lease(model)
    claimed = False
    if lease:
        try:
            claimed = registry.claim(fingerprint.content_digest, lease) is None
        except ValueError as exc:
            log.debug("weightcache: the claim on %s is not valid: %s", fingerprint.short, exc)
    _write_records(registry, model, fingerprint, declared)
    if not claimed:
        return
    key = registry.config.key("holders", fingerprint.content_digest, registry.config.node)
    deadline = time.monotonic() + SHARED_WAIT_S
    while registry.store.get(key) is None:
        if time.monotonic() > deadline:
            log.info(
                "weightcache: no sharing agent listed %s within %.0f s (run `weightcache fleet share` beside the server); "
                "the other nodes read it elsewhere",
                fingerprint.short,
                SHARED_WAIT_S,
            )
            return
        time.sleep(POLL_S)


def _write_records(
    registry: FleetRegistry, model: str | os.PathLike, fingerprint: Fingerprint, declared: CheckpointFiles | None
) -> None:
    """The fleet's record of each weight file of ``model``, where this node's store holds the digests of every declared
    file and they are those of ``fingerprint`` (a file changed meanwhile: none is written). Config files have none: a
    node that sees them hashes them (``_configs_hashed``)."""
    declared = declared or CheckpointFiles()
    headers = [read_header(file) for file in declared.weight_files(model)]
    sighting = Sighting.of(model, default_store(), headers=headers, declared=declared)
    if any(digest is None for digest in sighting.remembered):
        return
    known = typing.cast("list[str]", list(sighting.remembered))
    if identity_of(model, list(sighting.files), known) != fingerprint.checkpoint:
        return
    lease = registry.store.grant(FILE_RECORD_TTL_S)
    for header, digest in zip(headers, known, strict=False):
        registry.remember_file(FileContent(seen_of(header), digest, registry.config.node), lease)
    log.debug("weightcache: the fleet's records of %d files of %s written", len(headers), model)
