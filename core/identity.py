"""Building a fingerprint for a load request, before any weight is read."""

from __future__ import annotations

import functools

from weightcache.core.fingerprint import Fingerprint, ParallelSpec, canonical_json, sha256_json
from weightcache.core.request import LoadRequest, ModelDescription
from weightcache.core.safetensors_io import checkpoint_identity


@functools.cache
def _cuda_facts(device: str) -> tuple[str, str, str]:
    """(cuda version, compute capability, GPU UUID) of ``device``; empty strings on CPU."""
    import torch

    if not device.startswith("cuda"):
        return "", "", ""
    from weightcache.core.arena.devices import gpu_uuid

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    return str(torch.version.cuda or ""), f"{major}.{minor}", gpu_uuid(index)


def fingerprint_for(request: LoadRequest, description: ModelDescription) -> Fingerprint:
    """The fingerprint of ``request`` as ``description`` describes its model."""
    return make_fingerprint(
        request.model,
        architecture=description.architecture,
        config=description.config,
        dtype=request.dtype or "auto",
        device=request.device,
        parallel=request.parallel,
        quantization=description.quantization,
        quantization_config=description.quantization_config,
        adapter=request.adapter,
        adapter_version=description.adapter_version,
        engine=description.engine,
        engine_version=description.engine_version,
        extra=description.extra,
    )


def make_fingerprint(
    checkpoint,
    *,
    architecture: str,
    config: dict | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    parallel: ParallelSpec | None = None,
    quantization: str = "none",
    quantization_config: dict | None = None,
    adapter: str = "api",
    adapter_version: str = "",
    engine: str = "",
    engine_version: str = "",
    extra: dict | None = None,
) -> Fingerprint:
    """A fingerprint from its parts; the checkpoint identity, torch, CUDA and GPU facts are read here."""
    import torch

    cuda_version, capability, uuid = _cuda_facts(str(device))
    parallel = parallel or ParallelSpec()
    return Fingerprint(
        checkpoint=checkpoint_identity(checkpoint),
        architecture=architecture,
        config=sha256_json(config or {}),
        tp_size=parallel.tp_size,
        tp_rank=parallel.tp_rank,
        pp_size=parallel.pp_size,
        pp_rank=parallel.pp_rank,
        dp_size=parallel.dp_size,
        ep_size=parallel.ep_size,
        ep_rank=parallel.ep_rank,
        dtype=dtype,
        quantization=quantization,
        quantization_config=canonical_json(quantization_config or {}),
        adapter=adapter,
        adapter_version=adapter_version,
        engine=engine,
        engine_version=engine_version,
        torch_version=torch.__version__.split("+")[0],
        cuda_version=cuda_version,
        compute_capability=capability,
        gpu_uuid=uuid,
        extra=dict(extra or {}),
    )
