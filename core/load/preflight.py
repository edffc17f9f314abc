"""Checks a load runs before reading any weight: the device is usable here, the server has room.

``weightcache load`` runs them after ``prepare`` (adapter, options, quantization) and
before asking the server for the entry, so every mistake costs no weight read.
"""

from __future__ import annotations

import typing

from weightcache.core.device import Device
from weightcache.core.dtypes import item_size
from weightcache.core.errors import DeviceNotFound, DeviceUnavailable, NoMemory, NoRoom
from weightcache.core.load.prefetch import available_memory
from weightcache.core.request import ModelDescription

if typing.TYPE_CHECKING:
    from weightcache.core.client.replies import ServerStatus
    from weightcache.core.identity.safetensors_io import Header


def check_device(device: Device) -> None:
    """Raise DeviceUnavailable unless this process can use ``device``: checked before any weight is read.

    Nothing to check for the CPU; for a GPU, torch is imported and asked.
    """
    if not device.is_cuda:
        return
    import torch

    if not torch.cuda.is_available():
        build = "was built without CUDA" if torch.version.cuda is None else "finds no CUDA GPU"
        raise DeviceUnavailable(str(device), f"this torch ({torch.__version__}) {build}")
    try:
        device.torch_index()
    except DeviceNotFound as exc:
        raise DeviceUnavailable(str(device), f"this process sees {len(exc.visible)} GPUs ({', '.join(exc.visible)})") from None


_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


def estimated_bytes(headers: "typing.Sequence[Header]", description: ModelDescription) -> int:
    """A lower bound of the bytes an entry of this checkpoint holds, from its headers alone.

    Floating-point tensors count at the resolved dtype (one byte each when quantized); the
    rest as stored. Buffers the checkpoint lacks and arena padding only add to the real size.
    """
    per_float = 1 if description.quantization != "none" else item_size(description.resolved_dtype())
    return sum(
        tensor.nbytes // item_size(tensor.dtype) * per_float if tensor.dtype in _FLOATING else tensor.nbytes
        for header in headers
        for tensor in header.tensors
    )


def check_room(status: "ServerStatus", needed: int, tier: str = "host") -> None:
    """Raise NoRoom when a server whose ``status`` reply this is could not hold ``needed`` more bytes on ``tier``.

    ``tier`` is ``host`` or a GPU's UUID; the total budget and the tier's own both count.
    Conservative: it refuses only when the entry cannot fit even after the server evicts
    every idle entry (those no engine has attached); the server has the last word at publish.
    """
    budgets = status.budgets
    attached = [entry for entry in status.entries if entry.attached_pids]
    key, which, flag = (
        ("host", "host budget", "--host-budget") if tier == "host" else ("per_gpu", "per-GPU budget", "--gpu-budget")
    )
    checks = [
        (budgets.get("total"), sum(e.nbytes for e in attached), "budget", "--byte-budget"),
        (budgets.get(key), sum(e.nbytes for e in attached if e.tier == tier), which, flag),
    ]
    for budget, held, which, flag in checks:
        if budget and needed > budget - held:
            raise NoRoom(needed, budget, held, which, flag)


def free_bytes(device: Device) -> int:
    """Bytes ``device`` can still hold: a GPU's free memory (asked on that GPU), or the host's available memory."""
    if device.is_cuda:
        import torch

        free, _total = torch.cuda.mem_get_info(device.torch())
        return int(free)
    available = available_memory()
    if available is None:
        raise OSError("/proc/meminfo has no MemAvailable line; this check needs Linux 3.14 or later")
    return available


def check_memory(device: Device, needed: int) -> None:
    """Raise NoMemory unless ``device`` has ``needed`` bytes free now (checked before allocating a peer's arenas)."""
    free = free_bytes(device)
    if needed > free:
        raise NoMemory(str(device), needed, free)
