"""Building a fingerprint for a load request, before any weight is read."""

from __future__ import annotations

import functools

import attrs

from weightcache.core import PROTOCOL_VERSION
from weightcache.core.device import Device
from weightcache.core.fingerprint import Fingerprint, canonical_json, sha256_json
from weightcache.core.identity.safetensors_io import checkpoint_identity
from weightcache.core.request import LoadRequest, ModelDescription


@attrs.frozen
class Environment:
    """The fingerprint fields this process and its device contribute (empty CUDA fields on the CPU)."""

    torch_version: str
    cuda_version: str
    compute_capability: str
    gpu_uuid: str
    protocol_version: int = PROTOCOL_VERSION

    @classmethod
    def of(cls, device: Device) -> "Environment":
        return _environment(device)


@functools.cache
def _environment(device: Device) -> Environment:
    import torch

    torch_version = torch.__version__.split("+")[0]
    if not device.is_cuda:
        return Environment(torch_version, "", "", "")
    from weightcache.core.device import gpu_uuid

    index = device.torch_index()
    major, minor = torch.cuda.get_device_capability(index)
    return Environment(torch_version, str(torch.version.cuda or ""), f"{major}.{minor}", gpu_uuid(index))


def fingerprint_for(request: LoadRequest, description: ModelDescription, checkpoint: str | None = None) -> Fingerprint:
    """The fingerprint of ``request`` as ``description`` describes its model.

    :param checkpoint: the checkpoint identity, if already known (default: computed from ``request.model``).
    """
    return Fingerprint(
        checkpoint=checkpoint if checkpoint is not None else checkpoint_identity(request.model),
        architecture=description.architecture,
        config=sha256_json(description.config),
        dtype=description.resolved_dtype(),
        quantization=description.quantization,
        quantization_config=canonical_json(description.quantization_config),
        adapter=request.adapter,
        adapter_version=description.adapter_version,
        engine=description.engine,
        engine_version=description.engine_version,
        extra=dict(description.extra),
        **attrs.asdict(request.parallel),
        **attrs.asdict(Environment.of(request.device)),
    )
