"""The fleet's registry: signed records (``records``) in etcd (``etcd``), read and written by content digest.

Every read checks the signature and the shape of each record; a record that fails is
left out and named in ``problems`` (a broken or lying node costs a warning, never a
wrong byte). Every call is bounded by the store's deadline (FleetUnavailable).
"""

from __future__ import annotations

import logging
import threading
import typing

import attrs

from weightcache.core.errors import FleetUnavailable
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.etcd import EtcdStore, KeyValue, Watch
from weightcache.core.node.fleet.records import Agent, Claim, Content, FileContent, FileSeen, Holding, Relay, opened, seal

log = logging.getLogger(__name__)

Record = typing.TypeVar("Record", Holding, Relay)


@attrs.define
class FleetRegistry:
    """Read and write the fleet's records for one node (``config.node``)."""

    config: FleetConfig
    store: EtcdStore = attrs.field()

    @store.default
    def _store(self) -> EtcdStore:
        return EtcdStore(self.config.endpoints, self.config.deadline_s, self.config.access)

    def _content_key(self, content_digest: str) -> bytes:
        return self.config.key("content", content_digest)

    def _holding_key(self, content_digest: str, node: str) -> bytes:
        return self.config.key("holders", content_digest, node)

    def _claim_key(self, content_digest: str) -> bytes:
        return self.config.key("claims", content_digest)

    def _relay_key(self, content_digest: str, node: str) -> bytes:
        return self.config.key("relays", content_digest, node)

    def _slot_key(self, content_digest: str, holder: str, index: int) -> bytes:
        return self.config.key("readers", content_digest, holder, str(index))

    def content(self, content_digest: str) -> Content | None:
        """The content record of ``content_digest``, None if there is none; ValueError if it is not a valid one."""
        key = self._content_key(content_digest)
        value = self.store.get(key)
        if value is None:
            return None
        content = opened(key, value, self.config.secret, Content.from_json)
        if content.fingerprint.content_digest != content_digest:
            raise ValueError("the content record names another content than its key")
        return content

    def declare(self, content: Content, lease: int) -> Content:
        """Write ``content``'s record unless one exists; returns the record in force (ours or the earlier one)."""
        content_digest = content.fingerprint.content_digest
        key = self._content_key(content_digest)
        value = seal(key, content.to_json(), self.config.secret)
        existing = self.store.create(key, value, lease)
        if existing is None:
            return content
        try:
            found = self.content(content_digest)
        except ValueError as exc:  # not a record of this fleet's: ours takes its place
            log.warning("weightcache: replacing the fleet's record of %s, which is not valid: %s", content_digest[:12], exc)
            self.store.put(key, value, lease)
            return content
        return found if found is not None else content

    def holdings(self, content_digest: str) -> tuple[list[Holding], list[str]]:
        """The valid holdings of ``content_digest`` (other nodes' only), and a line per record left out."""
        found, problems = self._records("holders", content_digest, lambda body, _: Holding.from_json(body), "node")
        return [holding for holding in found if holding.node != self.config.node], problems

    def _records(
        self, kind: str, content_digest: str, parse: typing.Callable[[dict, KeyValue], Record], label: str
    ) -> tuple[list[Record], list[str]]:
        """Every valid record under ``kind/<content>/<node>``, parsed by ``parse(body, item)`` and checked to name its
        key's node and content; and a line per record left out (``label node: why``)."""
        prefix = self.config.key(kind, content_digest) + b"/"
        found, problems = [], []
        for item in self.store.range(prefix):
            node = item.key[len(prefix) :].decode(errors="replace")
            try:
                found.append(self._record(item, node, content_digest, parse))
            except ValueError as exc:
                problems.append(f"{label} {node}: {exc}")
        return found, problems

    def _record(self, item: KeyValue, node: str, content_digest: str, parse: typing.Callable[[dict, KeyValue], Record]) -> Record:
        """The record ``item`` (the key of ``node`` for ``content_digest``), unsealed and checked; ValueError if not."""
        record = opened(item.key, item.value, self.config.secret, lambda body: parse(body, item))
        if record.node != node:
            raise ValueError(f"it names node {record.node!r}")
        if record.fingerprint.content_digest != content_digest:
            raise ValueError("it names another content than its key")
        return record

    def hold(self, holding: Holding, lease: int) -> None:
        key = self._holding_key(holding.fingerprint.content_digest, holding.node)
        self.store.put(key, seal(key, holding.to_json(), self.config.secret), lease)

    def drop(self, content_digest: str) -> None:
        """Remove this node's holding of ``content_digest``."""
        self.store.delete(self._holding_key(content_digest, self.config.node))

    def claim(self, content_digest: str, lease: int) -> Claim | None:
        """Claim the disk read of ``content_digest`` under ``lease``: None when this node now holds the claim, else the
        claim in force (another node's). ValueError for a claim in the store that is not valid (not signed with the
        fleet's secret, another shape): nobody can be waited for."""
        return self._claim(self._claim_key(content_digest), lease)

    def _claim(self, key: bytes, lease: int) -> Claim | None:
        mine = Claim(self.config.node)
        existing = self.store.create(key, seal(key, mine.to_json(), self.config.secret), lease)
        if existing is None:
            return None
        other = opened(key, existing, self.config.secret, Claim.from_json)
        return None if other == mine else other

    def take_name(self, agent: Agent, lease: int) -> Agent | None:
        """Take this node's name for ``agent`` under ``lease``: None when it holds it now, else the agent that does. A
        record there that is not valid is replaced."""
        key = self.config.key("nodes", agent.node)
        value = seal(key, agent.to_json(), self.config.secret)
        existing = self.store.create(key, value, lease)
        if existing is None:
            return None
        try:
            other = opened(key, existing, self.config.secret, Agent.from_json)
        except ValueError as exc:
            log.warning("weightcache: replacing the record of node %s's agent, which is not valid: %s", agent.node, exc)
            self.store.put(key, value, lease)
            return None
        return None if other == agent else other

    def file(self, seen: FileSeen) -> FileContent | None:
        """The fleet's record of the weight file ``seen``; None when there is none. ValueError for one that is not
        valid, or that names another identity than its key."""
        key = self.config.key("files", seen.name)
        value = self.store.get(key)
        if value is None:
            return None
        record = opened(key, value, self.config.secret, FileContent.from_json)
        if record.seen != seen:
            raise ValueError("the record of a file names another file identity than its key")
        return record

    def remember_file(self, record: FileContent, lease: int) -> None:
        """Write ``record`` unless the file has one (a record of an identity never changes)."""
        key = self.config.key("files", record.seen.name)
        self.store.create(key, seal(key, record.to_json(), self.config.secret), lease)

    def sighting_key(self, name: str) -> bytes:
        return self.config.key("sightings", name)

    def claim_sighting(self, name: str, lease: int) -> Claim | None:
        """Claim the first read of the checkpoint whose files' identities give ``name`` (``files.sighting_name``), as
        ``claim`` claims a content's disk read; ValueError for an invalid claim in the store."""
        return self._claim(self.sighting_key(name), lease)

    def take_slot(self, content_digest: str, holder: str, lease: int) -> bytes | None:
        """One of ``config.fanout`` reader slots on ``holder`` for this node, under ``lease`` (a node that dies frees
        its slot with it): the slot's key, None when every slot is taken."""
        for index in range(self.config.fanout):
            key = self._slot_key(content_digest, holder, index)
            if self.store.create(key, seal(key, {"node": self.config.node}, self.config.secret), lease) is None:
                return key
        return None

    def free_slot(self, key: bytes) -> None:
        self.store.delete(key)

    def relay(self, relay: Relay, lease: int) -> None:
        """List (or update) this node's relay record under ``lease``: its create revision stays the first put's."""
        key = self._relay_key(relay.fingerprint.content_digest, relay.node)
        self.store.put(key, seal(key, relay.to_json(), self.config.secret), lease)

    def relays(self, content_digest: str) -> tuple[list[Relay], list[str]]:
        """The valid relay records of ``content_digest`` (this node's too), oldest first, and a line per one left out."""
        found, problems = self._records(
            "relays", content_digest, lambda body, item: Relay.from_json(body, item.create_revision), "relay"
        )
        return sorted(found, key=lambda relay: relay.revision), problems

    def relay_of(self, content_digest: str, node: str) -> Relay | None:
        """``node``'s relay record of ``content_digest``; None when it has none, or none that is valid (left out, as
        ``relays`` leaves it out)."""
        return self.relay_in(self.store.get_item(self._relay_key(content_digest, node)), content_digest, node)

    def relay_in(self, item: KeyValue | None, content_digest: str, node: str) -> Relay | None:
        """The relay record ``item`` holds (``node``'s key of ``content_digest``, as read or as a watch brought it);
        None for none, or one that is not valid."""
        if item is None or item.key != self._relay_key(content_digest, node):
            return None
        try:
            return self._record(item, node, content_digest, lambda body, kv: Relay.from_json(body, kv.create_revision))
        except ValueError as exc:
            log.debug("weightcache: leaving out relay %s: %s", node, exc)
            return None

    def watch_relay(self, content_digest: str, node: str) -> Watch:
        """A watch on ``node``'s relay record of ``content_digest`` (it wakes a waiter; the record is read as before)."""
        return self.store.watch(self._relay_key(content_digest, node))

    def drop_relay(self, content_digest: str) -> None:
        """Remove this node's relay record of ``content_digest``."""
        self.store.delete(self._relay_key(content_digest, self.config.node))

    def claimed(self, content_digest: str) -> bool:
        return self.store.get(self._claim_key(content_digest)) is not None


def renew_lease(
    registry: FleetRegistry,
    current: typing.Callable[[], int],
    stop: threading.Event,
    ran_out: typing.Callable[[int], None] | None = None,
) -> None:
    """Renew the lease ``current()`` names every third of the lease's TTL until ``stop`` is set (a thread's target).

    A renewal that times out is logged at debug and tried again next time; a lease that had run out (its keys are
    gone) is passed to ``ran_out``. ``current()`` is read each time, so its owner may grant a new lease meanwhile;
    0 means none yet.
    """
    every = max(registry.config.lease_ttl_s / 3, 0.2)
    while not stop.wait(every):
        lease = current()
        if not lease:
            continue
        try:
            left = registry.store.keepalive(lease)
        except FleetUnavailable as exc:
            log.debug("weightcache: renewing lease %x: %s", lease, exc)
            continue
        if left <= 0 and ran_out is not None:
            ran_out(lease)
