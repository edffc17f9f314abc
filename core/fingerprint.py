"""Fingerprints: everything that must match before mapped weights can stand in for a disk load."""

from __future__ import annotations

import hashlib
import json
import typing

import attrs

from weightcache.core import PROTOCOL_VERSION


def canonical_json(value: typing.Any) -> str:
    """JSON with sorted keys and no spaces: the same value always gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_json(value: typing.Any) -> str:
    """sha256 hex digest of ``value``'s canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


@attrs.frozen
class ParallelSpec:
    """This rank's place in tensor, pipeline, data and expert parallelism.

    The data-parallel rank is left out on purpose: replicas hold identical
    weights, so replicas on one GPU may share one copy.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    ep_size: int = 1
    ep_rank: int = 0

    def __attrs_post_init__(self):
        for size, rank in ((self.tp_size, self.tp_rank), (self.pp_size, self.pp_rank), (self.ep_size, self.ep_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"parallel rank {rank} does not fit size {size}")

    @property
    def label(self) -> str:
        """``tp0/2 pp0/1 ep0/1``: the one way a rank is written (status, labels, logs)."""
        return f"tp{self.tp_rank}/{self.tp_size} pp{self.pp_rank}/{self.pp_size} ep{self.ep_rank}/{self.ep_size}"


LINEAGE_KEY: typing.Final = "refit_lineage"
"""The key of ``Fingerprint.extra`` that names a version's lineage (``Fingerprint.lineage``)."""
VERSION_KEY: typing.Final = "refit_version"
"""The key of ``Fingerprint.extra`` that holds a version's number (``Fingerprint.version``)."""

HOST_TIER: typing.Final = "host"
"""The ``gpu_uuid`` of a GPU-made entry held in host memory (the host tier): GPUs of the same kind fill from it."""


@attrs.frozen(hash=False)
class Fingerprint:
    """Identity of one cached model rank; two fingerprints match only if every field is equal.

    Build it before loading (post-processing may mutate configs), with
    ``weightcache.core.identity.identity.fingerprint_for``. The fields are declared here
    once; everything else iterates ``attrs.fields(Fingerprint)`` (``FIELDS``).
    """

    checkpoint: str
    architecture: str
    config: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    ep_size: int
    ep_rank: int
    dtype: str
    quantization: str
    quantization_config: str
    adapter: str
    adapter_version: str
    engine: str
    engine_version: str
    torch_version: str
    cuda_version: str
    compute_capability: str
    gpu_uuid: str
    protocol_version: int = PROTOCOL_VERSION
    extra: dict = attrs.field(factory=dict)

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Fingerprint":
        names = {f.name for f in attrs.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            missing = sorted(names - set(data)) if isinstance(data, dict) else sorted(names)
            unknown = sorted(set(data) - names) if isinstance(data, dict) else []
            raise ValueError(f"malformed fingerprint: missing {missing}, unknown {unknown}")
        for field in attrs.fields(cls):
            expected = _JSON_TYPES[field.type]
            value = data[field.name]
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(
                    f"malformed fingerprint: field {field.name} must be {expected.__name__}, not {type(value).__name__}"
                )
        return cls(**data)

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON of every field."""
        return sha256_json(self.to_json())

    @property
    def content_digest(self) -> str:
        """The digest of everything but ``gpu_uuid``: the same bytes, wherever on the node they are held.

        Entries of one content on two GPUs of a kind, or on the host tier (``HOST_TIER``), are copies of each
        other; a GPU's entry may be filled from any of them (``weightcache.core.node.fill``).
        """
        return sha256_json({**self.to_json(), "gpu_uuid": None})

    def on_device(self, gpu_uuid: str) -> "Fingerprint":
        """This fingerprint for the copy held on ``gpu_uuid`` (a GPU's UUID, or ``HOST_TIER``)."""
        return attrs.evolve(self, gpu_uuid=gpu_uuid)

    @property
    def short(self) -> str:
        return self.digest[:12]

    def mismatched_fields(self, other: "Fingerprint | dict") -> tuple[str, ...]:
        """Names of the fields that differ from ``other`` (``extra.KEY`` for adapter fields)."""
        mine, theirs = self.to_json(), other.to_json() if isinstance(other, Fingerprint) else dict(other)
        fields = [name for name in mine if name != "extra" and mine[name] != theirs.get(name)]
        extra_mine, extra_theirs = mine["extra"], theirs.get("extra") or {}
        fields += [f"extra.{k}" for k in sorted(set(extra_mine) | set(extra_theirs)) if extra_mine.get(k) != extra_theirs.get(k)]
        return tuple(fields)

    @property
    def lineage(self) -> str:
        """The digest of the entry published from disk that this one is a version of (its own digest for that entry)."""
        found = self.extra.get(LINEAGE_KEY)
        return found if isinstance(found, str) else self.digest

    @property
    def version(self) -> int:
        """Which version of its lineage this entry holds: 0 for the one published from disk, then 1, 2, ... (refit)."""
        found = self.extra.get(VERSION_KEY)
        return found if type(found) is int and found >= 0 else 0

    def as_version(self, version: int, content: str) -> "Fingerprint":
        """The fingerprint of version ``version`` of this entry's lineage, whose bytes have the identity ``content``.

        Everything but the checkpoint's identity is this fingerprint's: a version differs only in its weights.
        """
        if type(version) is not int or version < 1:
            raise ValueError(f"a published version is a whole number from 1 up, not {version!r:.40}")
        extra = {**self.extra, LINEAGE_KEY: self.lineage, VERSION_KEY: version}
        return attrs.evolve(self, checkpoint=f"version:{content}", extra=extra)

    @property
    def parallel(self) -> ParallelSpec:
        """This rank's place in parallelism (its ``label`` names the rank)."""
        return ParallelSpec(**{f.name: getattr(self, f.name) for f in attrs.fields(ParallelSpec)})


_JSON_TYPES = {"str": str, "int": int, "dict": dict}
FIELDS: typing.Final = tuple(f.name for f in attrs.fields(Fingerprint))
