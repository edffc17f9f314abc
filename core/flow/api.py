"""The Python API for engine forks: publish a state, attach by fingerprint, rebind a meta model.

    from weightcache.core.flow import api

    fp = api.fingerprint("/models/llama", architecture="LlamaForCausalLM", dtype="bfloat16", device="cuda:0")
    api.publish_model(model, fp, device="cuda:0")                  # loader side (once): parameters and every buffer
    attachment = api.attach(fp)                                    # engine side
    api.rebind(meta_model, attachment, device="cuda:0")            # zero-copy, checked

Everything here is built on the same pieces as the CLI and the adapters.
"""

from __future__ import annotations

import os
import typing

from weightcache.core.client.attach import Attachment
from weightcache.core.fingerprint import Fingerprint, ParallelSpec
from weightcache.core.flow.loader import DISK, Origin, Published
from weightcache.core.identity.digests import ProgressLike
from weightcache.core.identity.identity import fingerprint_for
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.layout.tensor_table import contiguous_stride
from weightcache.core.load.export import DEFAULT_CHUNK_BYTES, ArenaBuilder, export_module, export_state
from weightcache.core.load.publish import publish_arenas
from weightcache.core.load.reader import read_checkpoint
from weightcache.core.request import LoadRequest, ModelDescription
from weightcache.core.socket_dir import SocketDirLike

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.device import Device

IN_MEMORY = Origin("memory")

__all__ = [
    "Attachment",
    "Published",
    "PublishedState",
    "attach",
    "fingerprint",
    "publish_checkpoint",
    "publish_model",
    "publish_state",
    "rebind",
]


def fingerprint(
    checkpoint: str | os.PathLike,
    *,
    architecture: str,
    dtype: str,
    device: str = "cpu",
    config: dict | None = None,
    parallel: ParallelSpec | None = None,
    quantization: str = "none",
    quantization_config: dict | None = None,
    adapter: str = "api",
    adapter_version: str = "",
    engine: str = "",
    engine_version: str = "",
    extra: dict | None = None,
) -> Fingerprint:
    """The fingerprint of a model your engine describes itself (the checkpoint's content, torch, CUDA and GPU facts are read here).

    Put everything that changes the final weights into it: ``config`` (hashed),
    ``dtype``, the quantization method and its config, and in ``extra`` any
    kernel backend or flag your post-processing depends on.
    """
    request = LoadRequest(model=str(checkpoint), adapter=adapter, dtype=dtype, device=device, parallel=parallel or ParallelSpec())
    description = ModelDescription(
        architecture=architecture,
        config=dict(config or {}),
        dtype=dtype,
        quantization=quantization,
        quantization_config=dict(quantization_config or {}),
        adapter_version=adapter_version,
        engine=engine,
        engine_version=engine_version,
        extra=dict(extra or {}),
    )
    return fingerprint_for(request, description)


PublishedState = Published
"""The name 0.1.0 gave these functions' result: it is ``Published`` now, the one type of a publish's result."""


def publish_model(
    model: "torch.nn.Module",
    fingerprint: Fingerprint,
    *,
    device: str = "cpu",
    socket_dir: SocketDirLike = None,
    label: str = "",
    extra: dict | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Published:
    """Copy every parameter and buffer of ``model`` (non-persistent buffers too; tied weights once) into arenas and publish.

    The model keeps its own tensors (nothing is freed); prefer this to
    ``publish_state(model.state_dict())``, which misses non-persistent buffers.
    """
    with ArenaBuilder(device, chunk_bytes=chunk_bytes) as builder:
        manifest = export_module(model, builder, extra, release=False)
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label)
    return Published(reply.digest, reply.created, fingerprint, manifest, origin=IN_MEMORY)


def publish_state(
    state: "typing.Mapping[str, torch.Tensor]",
    fingerprint: Fingerprint,
    *,
    device: str = "cpu",
    socket_dir: SocketDirLike = None,
    label: str = "",
    extra: dict | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Published:
    """Copy ``state`` (final tensors, any dtype and stride) into arenas on ``device`` and publish it.

    The same tensor object under two names is stored once, as an alias.
    """
    with ArenaBuilder(device, chunk_bytes=chunk_bytes) as builder:
        manifest = export_state(state, builder, extra)
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label)
    return Published(reply.digest, reply.created, fingerprint, manifest, origin=IN_MEMORY)


def publish_checkpoint(
    path: str | os.PathLike,
    fingerprint: Fingerprint,
    *,
    device: str = "cpu",
    socket_dir: SocketDirLike = None,
    label: str = "",
    progress: ProgressLike | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Published:
    """Read a safetensors checkpoint's bytes straight into arenas on ``device`` (no second copy) and publish it.

    Tensors keep the names, dtypes and shapes of the files.
    """
    with ArenaBuilder(device, chunk_bytes=chunk_bytes, progress=progress) as builder:
        placed = read_checkpoint(path, builder)
        records = [
            TensorRecord(
                name=name,
                kind="parameter",
                dtype=info.dtype,
                shape=info.shape,
                stride=contiguous_stride(info.shape),
                storage_offset=0,
                arena=slot.arena,
                offset=slot.offset,
                nbytes=slot.nbytes,
            )
            for name, (info, slot) in placed.items()
        ]
        manifest = Manifest(tensors=records, arenas=builder.specs())
        builder.progress.close()
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label)
    return Published(reply.digest, reply.created, fingerprint, manifest, origin=DISK)


def attach(fingerprint: Fingerprint, socket_dir: SocketDirLike = None, timeout: float = 30.0) -> Attachment:
    """Map the entry for ``fingerprint``; its ``tensors`` view the shared memory. Close it when done.

    An entry not verified since a server crash is checksummed before it is returned.

    Raises ServerUnavailable, FingerprintMismatch (``.fields``), EntryNotFound or EntryCorrupt (the entry's bytes
    changed: load from disk; it was dropped from the server unless others have it attached).
    """
    return Attachment.open(fingerprint, socket_dir, timeout=timeout)


def rebind(model: "torch.nn.Module", attachment: Attachment, device: "Device | str | None" = None) -> "torch.nn.Module":
    """Point every parameter and buffer of a meta-device ``model`` at the attachment's tensors.

    Raises RebindError when a tensor is missing, has another shape or stays on meta.
    """
    from weightcache.core.device import Device
    from weightcache.core.load.rebind import rebind_module

    return rebind_module(
        model, attachment.tensors, attachment.manifest, device=None if device is None else Device.parse(device).torch()
    )
