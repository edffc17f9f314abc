"""Where weights live: ``cpu`` or one CUDA GPU, parsed once where a device enters weightcache.

Accepted spellings: ``cpu``; ``cuda`` (the current GPU), ``cuda:N`` (torch's index
in this process); ``GPU-<uuid>`` or ``MIG-<uuid>`` (as nvidia-smi prints it: the
same GPU in every process, whatever ``CUDA_VISIBLE_DEVICES`` says). Anything else
(``gpu``, ``mps``, ``cpu:0``, ``cuda0``) is refused with the list above, before any
weight is read. Parsing needs no torch; asking for the GPU's UUID or index does.
"""

from __future__ import annotations

import re
import typing
import uuid as _uuid

import attrs

if typing.TYPE_CHECKING:
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
        from weightcache.core.arena.devices import cuda_index

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


def canonical_uuid(text: str) -> str | None:
    """``GPU-``/``MIG-`` and the lower-case UUID for a prefixed UUID, else None."""
    match = _PREFIXED_UUID.match(text.strip())
    if match is None:
        return None
    try:
        return f"{match.group(1).upper()}-{_uuid.UUID(match.group(2))}"
    except ValueError:
        return None
