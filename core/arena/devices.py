"""GPUs named by UUID, so every process means the same GPU by an arena's device.

A CUDA index depends on ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` of
the process that uses it; a UUID (``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``,
as nvidia-smi prints it) does not.  ``ArenaSpec.device`` holds ``cpu`` or a
UUID; these functions turn it into an index of this process and back.
torch is imported on first use only.
"""

from __future__ import annotations

import typing
import uuid as _uuid

from weightcache.core.device import SPELLINGS, Device, canonical_uuid
from weightcache.core.errors import DeviceNotFound

if typing.TYPE_CHECKING:
    import torch


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
    from weightcache.core.arena.driver import check, driver

    cu = driver()
    check(cu.cuInit(0), "cuInit")
    device = check(cu.cuDeviceGet(index), "cuDeviceGet")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    return bytes(check(get_uuid(device), "cuDeviceGetUuid").bytes)
