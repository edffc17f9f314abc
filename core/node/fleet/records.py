"""What the fleet's registry holds, as value objects, each value signed with the fleet's shared secret.

Six kinds of key, under the fleet's prefix and an entry's content digest
(``Fingerprint.content_digest``: every field but the GPU's UUID) or a weight file's storage identity:

- ``content/<content>``: what that content's arenas are (``Content``): the sha256 of its
  manifest and each arena's size and checksum, written once by the first node that
  read it from the disk and published it;
- ``holders/<content>/<node>``: a node that holds it and how to read it (``Holding``);
- ``claims/<content>``: a node that is reading it from the disk now (``Claim``);
- ``relays/<content>/<node>``: a node pulling it now, and the leading arenas it has read,
  sealed and checked so far, which it serves to the node behind it (``Relay``);
- ``files/<identity>``: the content digest of a weight file, keyed by what a node sees of it without reading its
  weights (``FileSeen``: size, times, inode, the sha256 of its header), written by a node that hashed it (``FileContent``);
- ``sightings/<identity>``: a node that reads a checkpoint nobody has hashed yet (``Claim``);
- ``nodes/<node>``: the sharing agent that goes by that node's name (``Agent``): one per name.

Every value is ``{"body": ..., "mac": ...}`` with an HMAC-SHA256 over the key and the
body's canonical JSON: a record moved to another key, changed, or written without the
secret is refused (``unseal``). A value of any shape or depth is refused with a ValueError, never another
exception (``opened``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import typing

import attrs

from weightcache.core.arena.checksum import is_checksum
from weightcache.core.fingerprint import Fingerprint, canonical_json, sha256_json
from weightcache.core.identity.digests import SCHEME
from weightcache.core.node.fleet.transport import MAX_REGION_BYTES, Region
from weightcache.core.wire.protocol import MAX_FRAME_BYTES

MAX_RECORD_BYTES: typing.Final = 1 << 20
"""Largest record read from the registry (a holding of thousands of arenas stays far below)."""
MAX_ARENAS: typing.Final = 65536
MAX_NAME_CHARS: typing.Final = 253


def seal(key: bytes, body: dict, secret: bytes) -> bytes:
    """The registry value for ``body`` at ``key``: the body and its HMAC under ``secret``."""
    return json.dumps({"body": body, "mac": _mac(key, body, secret)}, separators=(",", ":")).encode()


def unseal(key: bytes, value: bytes, secret: bytes) -> dict:
    """The body of a value ``seal`` made for ``key`` with ``secret``; ValueError for anything else."""
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"a record of {len(value)} bytes (at most {MAX_RECORD_BYTES} are read)")
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError("a record that is not JSON, or nested too deep") from None
    if not isinstance(data, dict) or not isinstance(data.get("body"), dict) or not isinstance(data.get("mac"), str):
        raise ValueError("a record without a body and a mac")
    try:
        mac = _mac(key, data["body"], secret)
    except (ValueError, TypeError, RecursionError):
        raise ValueError("a record whose body cannot be written back as JSON (nested too deep?)") from None
    if not hmac.compare_digest(data["mac"].encode(errors="replace"), mac.encode()):
        raise ValueError("a record not signed with this fleet's secret (another fleet's, or forged)")
    return data["body"]


Parsed = typing.TypeVar("Parsed")


def opened(key: bytes, value: bytes, secret: bytes, parse: typing.Callable[[dict], Parsed]) -> Parsed:
    """``parse`` of the body of the value at ``key`` (``unseal``); ValueError for a value of any other shape.

    A signed record of this version always parses; anything else found in the store (another version's shape, a
    forgery, a deep or odd JSON value) is a ValueError naming why, never another exception that would end a load or
    the sharing agent.
    """
    body = unseal(key, value, secret)
    try:
        return parse(body)
    except ValueError:
        raise
    except (TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as exc:
        raise ValueError(f"a record of another shape ({type(exc).__name__}: {str(exc)[:80]})") from None


def _mac(key: bytes, body: dict, secret: bytes) -> str:
    return hmac.new(secret, key + b"\0" + canonical_json(body).encode(), hashlib.sha256).hexdigest()


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise ValueError(f"{what} is {value!r:.40}, not a name of 1 to {MAX_NAME_CHARS} characters")
    return value


def _sha256(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"{what} is not a sha256 in hex")
    return value


def _reach(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_RECORD_BYTES:
        raise ValueError("reach must be a non-empty string")
    return value


def _regions(value: object, least: int) -> tuple[Region, ...]:
    if not isinstance(value, list) or not least <= len(value) <= MAX_ARENAS:
        raise ValueError(f"arenas must be a list of {least} to {MAX_ARENAS} regions")
    return tuple(Region.from_json(region) for region in value)


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@attrs.frozen
class Content:
    """What a content's arenas are, as the node that read it from the disk published them."""

    fingerprint: Fingerprint
    manifest_sha256: str
    manifest_bytes: int
    arenas: tuple[tuple[int, str], ...]
    """Each arena's size and checksum, in the manifest's order."""
    origin: str

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.arenas)

    def to_json(self) -> dict:
        return {
            "fingerprint": self.fingerprint.to_json(),
            "manifest_sha256": self.manifest_sha256,
            "manifest_bytes": self.manifest_bytes,
            "arenas": [list(arena) for arena in self.arenas],
            "origin": self.origin,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Content":
        """ValueError naming the first field that is not what a node of this version writes."""
        fingerprint = Fingerprint.from_json(data.get("fingerprint"))  # type: ignore[arg-type]
        size = data.get("manifest_bytes")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_FRAME_BYTES:
            raise ValueError(f"a manifest of {size!r:.40} bytes (1 to {MAX_FRAME_BYTES})")
        arenas = data.get("arenas")
        if not isinstance(arenas, list) or not 0 < len(arenas) <= MAX_ARENAS:
            raise ValueError(f"arenas must be a list of 1 to {MAX_ARENAS} [size, checksum] pairs")
        pairs = []
        for arena in arenas:
            if not isinstance(arena, list) or len(arena) != 2:
                raise ValueError("an arena is [size, checksum]")
            nbytes, checksum = arena
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= MAX_REGION_BYTES:
                raise ValueError(f"an arena of {nbytes!r:.40} bytes")
            if not is_checksum(checksum):
                raise ValueError(f"an arena's checksum {checksum!r:.60} is not one this version computes")
            pairs.append((nbytes, checksum))
        return cls(
            fingerprint,
            _sha256(data.get("manifest_sha256"), "manifest_sha256"),
            size,
            tuple(pairs),
            _name(data.get("origin"), "origin"),
        )


@attrs.frozen
class Holding:
    """A node that holds a content and how to read it: its transport, the reach text, the manifest's and arenas' regions."""

    node: str
    fingerprint: Fingerprint
    manifest_sha256: str
    transport: str
    reach: str = attrs.field(repr=False)
    manifest: Region
    arenas: tuple[Region, ...]

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "fingerprint": self.fingerprint.to_json(),
            "manifest_sha256": self.manifest_sha256,
            "transport": self.transport,
            "reach": self.reach,
            "manifest": self.manifest.to_json(),
            "arenas": [region.to_json() for region in self.arenas],
        }

    @classmethod
    def from_json(cls, data: dict) -> "Holding":
        return cls(
            _name(data.get("node"), "node"),
            Fingerprint.from_json(data.get("fingerprint")),  # type: ignore[arg-type]
            _sha256(data.get("manifest_sha256"), "manifest_sha256"),
            _name(data.get("transport"), "transport"),
            _reach(data.get("reach")),
            Region.from_json(data.get("manifest")),
            _regions(data.get("arenas"), 1),
        )


@attrs.frozen
class Claim:
    """A node reading a content from the disk now; others wait for it instead of reading too."""

    node: str

    def to_json(self) -> dict:
        return {"node": self.node}

    @classmethod
    def from_json(cls, data: dict) -> "Claim":
        return cls(_name(data.get("node"), "node"))


@attrs.frozen
class Landing:
    """The arena a relay is reading now, as far as it has landed: the first ``landed`` bytes of ``region`` hold arena
    ``arena`` as its source served them, not yet checked (a node that reads them checks the whole arena itself)."""

    arena: int
    landed: int
    region: Region

    def to_json(self) -> dict:
        return {"arena": self.arena, "landed": self.landed, "region": self.region.to_json()}

    @classmethod
    def from_json(cls, data: object) -> "Landing":
        if not isinstance(data, dict):
            raise ValueError("landing must be an object")
        region = Region.from_json(data.get("region"))
        arena, landed = data.get("arena"), data.get("landed")
        if isinstance(arena, bool) or not isinstance(arena, int) or not 0 <= arena < MAX_ARENAS:
            raise ValueError(f"the landing arena is {arena!r:.20}, not an arena's index")
        if isinstance(landed, bool) or not isinstance(landed, int) or not 0 <= landed <= region.length:
            raise ValueError(f"{landed!r:.20} bytes landed in a region of {region.length}")
        return cls(arena, landed, region)


@attrs.frozen
class Relay:
    """A node pulling a content that serves what it has checked so far: the manifest (once checked) and its leading
    ``verified`` arenas, each read, sealed and checksummed against the content record; and, as it lands, the arena it
    reads now (``landing``, always the one after the verified ones; None between arenas and from older releases)."""

    node: str
    fingerprint: Fingerprint
    transport: str
    reach: str = attrs.field(repr=False)
    manifest: Region | None
    arenas: tuple[Region, ...]
    """The regions of its first ``verified`` arenas, in the manifest's order."""
    landing: Landing | None = None
    revision: int = attrs.field(default=0, eq=False)
    """etcd's create revision of its key (not signed: the store's order of the relays, which chains them)."""

    @property
    def verified(self) -> int:
        return len(self.arenas)

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "fingerprint": self.fingerprint.to_json(),
            "transport": self.transport,
            "reach": self.reach,
            "manifest": None if self.manifest is None else self.manifest.to_json(),
            "arenas": [region.to_json() for region in self.arenas],
            "verified": self.verified,
            **({} if self.landing is None else {"landing": self.landing.to_json()}),
        }

    @classmethod
    def from_json(cls, data: dict, revision: int = 0) -> "Relay":
        arenas = _regions(data.get("arenas"), 0)
        if data.get("verified") != len(arenas):
            raise ValueError(f"it says {data.get('verified')!r:.20} arenas are verified and lists {len(arenas)}")
        manifest = data.get("manifest")
        landing = None if data.get("landing") is None else Landing.from_json(data.get("landing"))
        if landing is not None and landing.arena != len(arenas):
            raise ValueError(f"it lands arena {landing.arena} with {len(arenas)} verified (the next one lands)")
        return cls(
            _name(data.get("node"), "node"),
            Fingerprint.from_json(data.get("fingerprint")),  # type: ignore[arg-type]
            _name(data.get("transport"), "transport"),
            _reach(data.get("reach")),
            None if manifest is None else Region.from_json(manifest),
            arenas,
            landing,
            revision,
        )


@attrs.frozen
class FileSeen:
    """A weight file as a node sees it without reading its weights: the storage object's identity (size, modification
    and change times, inode) and the sha256 of its safetensors header. The change time is set by the kernel on every
    write and every ``utime``, and no user can set it back, so a file changed after a record of it was made is seen
    with another identity (docs/decisions.md, "A node that has never hashed a checkpoint")."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    header_sha256: str

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: object) -> "FileSeen":
        if not isinstance(data, dict):
            raise ValueError("a file's identity must be an object")
        numbers: list[int] = []
        for name in ("size", "mtime_ns", "ctime_ns", "inode"):
            number = data.get(name)
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 1 << 64:
                raise ValueError(f"a file's identity holds {number!r:.40}, not a whole number")
            numbers.append(number)
        size, mtime_ns, ctime_ns, inode = numbers
        return cls(size, mtime_ns, ctime_ns, inode, _sha256(data.get("header_sha256"), "header_sha256"))

    @property
    def name(self) -> str:
        """Its registry key's last part."""
        return sha256_json(self.to_json())


@attrs.frozen
class FileContent:
    """The content digest of a weight file (``digest``: the digest store's scheme) as the node ``origin`` hashed it,
    when it had the identity ``seen``."""

    seen: FileSeen
    digest: str
    origin: str

    def to_json(self) -> dict:
        return {"seen": self.seen.to_json(), "digest": self.digest, "origin": self.origin}

    @classmethod
    def from_json(cls, data: dict) -> "FileContent":
        digest = data.get("digest")
        scheme, _, hexdigest = digest.partition(":") if isinstance(digest, str) else ("", "", "")
        if scheme != SCHEME:
            raise ValueError(f"a file digest {digest!r:.80} not of the scheme {SCHEME}")
        seen, origin = FileSeen.from_json(data.get("seen")), _name(data.get("origin"), "origin")
        return cls(seen, scheme + ":" + _sha256(hexdigest, "the file digest"), origin)


@attrs.frozen
class Agent:
    """The sharing agent that holds a node's name: its host, its process and the server it shares."""

    node: str
    host: str
    pid: int
    socket_dir: str

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Agent":
        pid, socket_dir = data.get("pid"), data.get("socket_dir")
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 1 << 32:
            raise ValueError(f"pid is {pid!r:.20}")
        if not isinstance(socket_dir, str) or len(socket_dir) > 4096:
            raise ValueError("socket_dir must be a path")
        return cls(_name(data.get("node"), "node"), _name(data.get("host"), "host"), pid, socket_dir)
