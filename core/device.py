"""Where weights live: ``cpu`` or one CUDA GPU, parsed once where a device enters weightcache, and found in this process.

Accepted spellings: ``cpu``; ``cuda`` (the current GPU), ``cuda:N`` (torch's index
in this process); ``GPU-<uuid>`` or ``MIG-<uuid>`` (as nvidia-smi prints it: the
same GPU in every process, whatever ``CUDA_VISIBLE_DEVICES`` says). Anything else
(``gpu``, ``mps``, ``cpu:0``, ``cuda0``) is refused with the list above, before any
weight is read. Parsing needs no torch; asking for the GPU's UUID or index does.

A CUDA index depends on ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` of
the process that uses it; a UUID does not. ``ArenaSpec.device`` holds ``cpu`` or a
UUID; the functions below turn it into an index of this process and back
(torch is imported on first use only).
"""

from __future__ import annotations

import re
import typing
import uuid as _uuid

import attrs

from weightcache.core.errors import DeviceNotFound

if typing.TYPE_CHECKING:
    import torch
    import torch as _torch  # aliased: the method Device.torch would shadow the module's name in the class body

_CUDA = re.compile(r"^cuda(?::(\d+))?$")
_PREFIXED_UUID = re.compile(r"^(GPU|MIG)-(.+)$", re.IGNORECASE)

SPELLINGS = "'cpu', 'cuda', 'cuda:N' or a GPU UUID ('GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx')"


@attrs.frozen
class Device:
    """One device: ``kind`` is ``cpu`` or ``cuda``; a CUDA device is named by ``index`` (None: current) or ``uuid``."""

    kind: str = attrs.field(validator=attrs.validators.in_(("cpu", "cuda")))
    index: int | None = None
    uuid: str | None = None

    @classmethod
    def parse(cls, value: "str | Device | object") -> "Device":
        """The device ``value`` names (a Device, a torch.device or text); ValueError for anything else."""
        if isinstance(value, Device):
            return value
        text = str(value).strip()
        if text == "cpu":
            return cls("cpu")
        match = _CUDA.match(text)
        if match is not None:
            return cls("cuda", index=None if match.group(1) is None else int(match.group(1)))
        canonical = canonical_uuid(text)
        if canonical is not None:
            return cls("cuda", uuid=canonical)
        raise ValueError(f"{text!r} is not a device weightcache can use; use {SPELLINGS}")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def torch_index(self) -> int:
        """This process's torch index of the GPU (the current one for plain ``cuda``); DeviceNotFound if absent."""
        if not self.is_cuda:
            raise ValueError("the CPU has no CUDA index")
        return cuda_index(self.uuid or str(self))

    def torch(self) -> "_torch.device":
        """The ``torch.device`` for this process (a UUID becomes its index here)."""
        import torch

        return torch.device("cpu") if not self.is_cuda else torch.device("cuda", self.torch_index())

    def __str__(self) -> str:
        if not self.is_cuda:
            return "cpu"
        if self.uuid is not None:
            return self.uuid
        return "cuda" if self.index is None else f"cuda:{self.index}"


def to_device(value: "str | Device | object") -> "Device":
    """``Device.parse`` as an attrs converter (mypy's attrs plugin reads converters that are plain functions)."""
    return Device.parse(value)


def canonical_uuid(text: str) -> str | None:
    """``GPU-``/``MIG-`` and the lower-case UUID for a prefixed UUID, else None."""
    match = _PREFIXED_UUID.match(text.strip())
    if match is None:
        return None
    try:
        return f"{match.group(1).upper()}-{_uuid.UUID(match.group(2))}"
    except ValueError:
        return None


def gpu_uuid(index: int) -> str:
    """The UUID of the CUDA device with torch index ``index`` in this process.

    Read from torch's device properties; falls back to the driver's
    ``cuDeviceGetUuid`` where this torch lacks ``uuid``.
    """
    import torch

    raw = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if raw is None:
        return _format(_driver_uuid(index))
    if isinstance(raw, str):
        return _canonical(raw)
    return _format(bytes(raw.bytes))


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, in torch index order."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [gpu_uuid(index) for index in range(torch.cuda.device_count())]


def device_index_for_uuid(uuid: str) -> int:
    """The torch index, in this process, of the GPU with ``uuid``.

    :raises DeviceNotFound: no visible GPU has it (the error lists those that are).
    """
    wanted = _canonical(uuid)
    visible = visible_gpu_uuids()
    try:
        return visible.index(wanted)
    except ValueError:
        raise DeviceNotFound(wanted, visible) from None


def cuda_index(device: "Device | str | int | torch.device") -> int:
    """The torch index of a CUDA device: an index, or anything ``Device.parse`` takes (``cuda``, ``cuda:N``, a UUID)."""
    if isinstance(device, int):
        return _checked_index(device)
    parsed = Device.parse(device)
    if not parsed.is_cuda:
        raise ValueError(f"{device!r} is not a CUDA device; use {SPELLINGS}")
    if parsed.uuid is not None:
        return device_index_for_uuid(parsed.uuid)
    if parsed.index is None:
        import torch

        if not torch.cuda.is_available():
            raise DeviceNotFound("cuda", [])
        return torch.cuda.current_device()
    return _checked_index(parsed.index)


def device_label(device: "Device | str | torch.device") -> str:
    """``cpu`` for the CPU, else the UUID of the CUDA device (see :func:`cuda_index`)."""
    parsed = Device.parse(device)
    if not parsed.is_cuda:
        return "cpu"
    return parsed.uuid or gpu_uuid(cuda_index(parsed))


def _canonical(text: str) -> str:
    """``GPU-`` (or ``MIG-``) and the lower-case UUID, from a prefixed or bare UUID; ValueError for anything else."""
    found = canonical_uuid(text) or canonical_uuid(f"GPU-{text.strip()}")
    if found is None:
        raise ValueError(f"{text!r} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return found


def _format(raw: bytes) -> str:
    return f"GPU-{_uuid.UUID(bytes=bytes(raw))}"


def _checked_index(index: int) -> int:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= index < count:
        raise DeviceNotFound(f"cuda:{index}", visible_gpu_uuids())
    return index


def _driver_uuid(index: int) -> bytes:
    from weightcache.core.cuda_driver import check, driver

    cu = driver()
    check(cu.cuInit(0), "cuInit")
    device = check(cu.cuDeviceGet(index), "cuDeviceGet")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    return bytes(check(get_uuid(device), "cuDeviceGetUuid").bytes)
