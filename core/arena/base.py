"""The arena interface: memory that crosses processes as a file descriptor.

An arena backend creates writable arenas in a loader, seals them (after which
the bytes never change), and maps sealed arenas in other processes from the
fd alone.  Every backend hands out torch tensors that view the arena's memory
without a copy.
"""

from __future__ import annotations

import abc
import typing

import attrs

from weightcache.core.arena.checksum import SCHEME, is_checksum

if typing.TYPE_CHECKING:
    import torch


def _check_checksum(_spec, _attribute, value) -> None:
    if value is not None and not is_checksum(value):
        raise ValueError(f"checksum {value!r:.80} is not a {SCHEME} checksum ({SCHEME}: and 32 lower-case hex digits)")


@attrs.frozen
class ArenaSpec:
    """What a receiver needs besides the fd to map one arena.

    :param backend: backend name (``host`` or ``cuda``).
    :param size: bytes mapped (a multiple of the backend's granularity).
    :param device: ``cpu`` or the GPU UUID (``GPU-...``) the memory lives on.
    :param checksum: the checksum of the arena's ``size`` bytes (``weightcache.core.arena.checksum``),
        set when the arena is sealed; None before. Every published entry carries one per arena.
    """

    backend: str
    size: int = attrs.field(validator=attrs.validators.gt(0))
    device: str = "cpu"
    checksum: str | None = attrs.field(default=None, validator=_check_checksum)

    def to_json(self) -> dict:
        data = attrs.asdict(self)
        if self.checksum is None:
            del data["checksum"]  # an arena not sealed yet; the server refuses to publish it
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ArenaSpec":
        backend, size, device = data["backend"], data["size"], data["device"]
        if not isinstance(backend, str) or not isinstance(device, str):
            raise ValueError("backend and device must be strings")
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"size must be an integer, not {type(size).__name__}")
        return cls(backend=backend, size=size, device=device, checksum=data.get("checksum"))


class Arena(abc.ABC):
    """One block of shareable memory, mapped in this process."""

    spec: ArenaSpec

    @abc.abstractmethod
    def bytes_view(self) -> "torch.Tensor":
        """A uint8 tensor of ``spec.size`` bytes that views the whole arena."""

    @abc.abstractmethod
    def export_fd(self) -> int:
        """A new fd for this arena; the caller owns it and must close it."""

    @property
    @abc.abstractmethod
    def address(self) -> int:
        """Where the mapping starts in this process (a host address, or a CUDA device address)."""

    def fileno(self) -> int:
        """The fd this process holds for the arena's memory, still owned by the arena (a host arena's memfd).

        Only host arenas read and write their memory as a file; others raise TypeError: use ``export_fd()``.
        """
        raise TypeError(f"a {type(self).__name__} is not a file; use export_fd() for an fd to hand on")

    def take_memory_of(self, other: "Arena") -> None:
        """Map ``other``'s memory (an arena of the same backend and size) at this arena's addresses, in place of its own.

        Every tensor, CUDA graph or compiled kernel that holds this arena's addresses reads ``other``'s bytes afterwards;
        this arena holds ``other``'s memory from now on (and lets its old memory go), ``other`` keeps a handle of its own
        and is closed by its owner. The caller makes sure nothing reads the arena meanwhile (between two steps).
        An arena of a backend that cannot do it raises TypeError.
        """
        raise TypeError(f"a {type(self).__name__} cannot take another arena's memory; attach the new version instead")

    def unmap(self) -> None:
        """Drop this process's mapping of the memory where that is cheap to make again, keeping the memory held
        (a host arena maps its memfd again when next viewed); other arenas keep their mapping. Views must be dropped first.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap and release this process's handles (idempotent).

        Tensors viewing the arena must be dropped first; the memory itself
        lives on while any other process holds an fd or a mapping.
        """

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ArenaBackend(abc.ABC):
    """Creates, seals and maps arenas of one kind of memory."""

    name: str

    @abc.abstractmethod
    def granularity(self, device: str) -> int:
        """Arena sizes are rounded up to a multiple of this."""

    @abc.abstractmethod
    def create(self, size: int, device: str) -> Arena:
        """A new writable arena of at least ``size`` bytes on ``device``."""

    @abc.abstractmethod
    def seal(self, arena: Arena) -> None:
        """Make the arena's contents final; later maps are read-only where possible."""

    @abc.abstractmethod
    def map(self, fd: int, spec: ArenaSpec, *, writable: bool = False, on_device: int | None = None) -> Arena:
        """Map an arena received as ``fd`` (the fd is duplicated; the caller keeps its own).

        ``writable``: ask for a writable mapping (default: read-only where the backend can); ``on_device``: map it
        on this GPU index instead of its own (a peer copy; CUDA only, the host backend refuses it).
        """


PLAUSIBLE_GRANULE = 2 << 20
"""Allocation granularity assumed where the real one cannot be asked (the server has no CUDA; a seeding receiver
checks a peer's sizes): the driver's recommended VMM granularity on current GPUs, a multiple of any page size."""
PLAUSIBLE_SLACK = 2 << 20
"""Bytes an arena may declare beyond its tensors' extent rounded up to PLAUSIBLE_GRANULE (covers granularities up to 4 MiB)."""


def plausible_size(extent: int) -> int:
    """The most bytes an arena whose tensors reach ``extent`` bytes may declare: arenas are sized for what they hold."""
    return round_up(extent, PLAUSIBLE_GRANULE) + PLAUSIBLE_SLACK


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple
