"""Compile artifacts that travel with the weights: kept beside the entry, restored before compiling.

An engine that runs ``torch.compile`` pays the compile again on every start.
After its first compiled forward it calls ``publish_artifacts(loaded)``: the
bytes ``torch.compiler.save_cache_artifacts()`` returns go to the server as a
sealed memfd kept beside the entry (the server never reads them; see the
``put_artifact`` op in docs/protocol.md). A restarted or second engine calls
``restore_artifacts(loaded)`` before compiling, and inductor (and Triton on a
GPU) find their caches filled: ``torch.compile`` then skips the work they hold.

The key adds what the artifacts depend on beyond the entry's fingerprint:
torch's full version, Triton's, the device kind and, on a GPU, its name,
compute capability and CUDA version. An engine on another stack finds nothing
and compiles as usual. A missing server or entry is never an error unless
``strict``: the engine only compiles from scratch, with one warning.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
import typing

import attrs

from weightcache.core.client.client import Connection
from weightcache.core.device import Device
from weightcache.core.errors import AccessDenied, CompileArtifactsUnavailable, ServerError, ServerUnavailable
from weightcache.core.memfd import read_memfd, sealed_memfd
from weightcache.core.socket_dir import SocketDirLike

if typing.TYPE_CHECKING:
    from weightcache.core.flow.modes import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_NAME = "torch.compile"
_UNAVAILABLE = (ServerUnavailable, AccessDenied, ServerError)


@attrs.frozen
class ArtifactInfo:
    """One artifact published or restored: the entry's digest, the key, its size and how long the call took."""

    digest: str
    key: str
    nbytes: int
    seconds: float


def artifact_key(device: "Device | str" = "cpu", name: str = DEFAULT_NAME) -> str:
    """The key compile artifacts for ``device`` are kept under, e.g. ``torch.compile;torch=2.13.0+cpu;triton=none;device=cpu``.

    On a GPU: ``...;device=cuda;gpu=<the GPU's name>;sm=90;cuda=13.0``.
    """
    import torch

    device = Device.parse(device)
    parts = [name, f"torch={torch.__version__}", f"triton={_triton_version()}", f"device={device.kind}"]
    if device.is_cuda:
        index = device.torch_index()
        major, minor = torch.cuda.get_device_capability(index)
        parts += [f"gpu={torch.cuda.get_device_name(index)}", f"sm={major}{minor}", f"cuda={torch.version.cuda}"]
    return ";".join(parts)


def publish_artifacts(
    loaded: "LoadedModel",
    *,
    name: str = DEFAULT_NAME,
    socket_dir: SocketDirLike = None,
    timeout_s: float = 30.0,
    strict: bool = False,
) -> ArtifactInfo | None:
    """Keep this process's compile artifacts beside ``loaded``'s entry; call it after the first compiled forward.

    Returns what was kept, or None (with a warning) when nothing was compiled
    yet, ``loaded`` has no entry, or the server refused or is away; ``strict``
    raises CompileArtifactsUnavailable instead.
    """
    import torch

    start = time.perf_counter()
    if _entry(loaded, socket_dir, strict)[0] is None:
        return None
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        unavailable("nothing was compiled in this process yet; publish after the first compiled forward", strict)
        return None
    return keep_beside(loaded, artifact_key(loaded_device(loaded), name), saved[0], start, socket_dir, timeout_s, strict)


def restore_artifacts(
    loaded: "LoadedModel",
    *,
    name: str = DEFAULT_NAME,
    socket_dir: SocketDirLike = None,
    timeout_s: float = 30.0,
    strict: bool = False,
) -> ArtifactInfo | None:
    """Load the compile artifacts kept beside ``loaded``'s entry into torch's caches; call it before compiling.

    Returns what was loaded, or None when there are none for this stack
    (``artifact_key``), ``loaded`` has no entry or the server is away (a
    warning); ``strict`` raises CompileArtifactsUnavailable for the last two.
    """
    import torch

    start = time.perf_counter()
    key = artifact_key(loaded_device(loaded), name)
    found = fetch_beside(loaded, key, socket_dir, timeout_s, strict)
    if found is None:
        return None
    blob, digest = found
    torch.compiler.load_cache_artifacts(blob)
    info = ArtifactInfo(digest, key, len(blob), time.perf_counter() - start)
    log.info("restored %d bytes of compile artifacts from %s in %.3f s", info.nbytes, info.digest[:12], info.seconds)
    return info


def keep_beside(
    loaded: "LoadedModel", key: str, blob: bytes, start: float, socket_dir: SocketDirLike, timeout_s: float, strict: bool
) -> ArtifactInfo | None:
    """Send ``blob`` to the server as a sealed memfd kept under ``key`` beside ``loaded``'s entry.

    ``start`` is when the caller began (the info's seconds count from it).
    Returns what was kept, or None (a warning; CompileArtifactsUnavailable
    when ``strict``) when ``loaded`` has no entry or the server refused or is away.
    """
    digest, socket_dir = _entry(loaded, socket_dir, strict)
    if digest is None:
        return None
    fd = sealed_memfd(blob)
    try:
        with Connection(socket_dir, timeout=timeout_s) as connection:
            connection.put_artifact(digest, key, fd)
    except _UNAVAILABLE as exc:
        unavailable(f"the server did not keep the compile artifacts: {exc}", strict)
        return None
    finally:
        os.close(fd)
    info = ArtifactInfo(digest, key, len(blob), time.perf_counter() - start)
    log.info("published %d bytes of compile artifacts beside %s (%s)", info.nbytes, digest[:12], key)
    return info


def fetch_beside(
    loaded: "LoadedModel", key: str, socket_dir: SocketDirLike, timeout_s: float, strict: bool
) -> tuple[bytes, str] | None:
    """The bytes kept under ``key`` beside ``loaded``'s entry, and the entry's digest; None when there are none (logged).

    None with a warning (CompileArtifactsUnavailable when ``strict``) when
    ``loaded`` has no entry or the server is away.
    """
    digest, socket_dir = _entry(loaded, socket_dir, strict)
    if digest is None:
        return None
    try:
        with Connection(socket_dir, timeout=timeout_s) as connection:
            found = connection.get_artifact(digest, key)
    except _UNAVAILABLE as exc:
        unavailable(f"could not ask the server for compile artifacts: {exc}", strict)
        return None
    if found is None:
        log.info("no compile artifacts beside %s for %s; torch.compile starts cold", digest[:12], key)
        return None
    fd, size = found
    try:
        return read_memfd(fd, size), digest
    finally:
        os.close(fd)


def _entry(loaded: "LoadedModel", socket_dir: SocketDirLike, strict: bool) -> tuple[str | None, SocketDirLike]:
    """The digest of ``loaded``'s entry and the socket directory to ask, or (None, None) when it has no entry."""
    if loaded.attachment is None:
        unavailable(
            f"the model came from {loaded.source} without a cached entry (mode {loaded.mode!r}) to keep artifacts beside", strict
        )
        return None, None
    return loaded.attachment.digest, socket_dir if socket_dir is not None else loaded.attachment.socket_dir


def loaded_device(loaded: "LoadedModel") -> Device:
    """The device ``loaded``'s weights live on, as its fingerprint names it."""
    uuid = loaded.fingerprint.gpu_uuid if loaded.fingerprint is not None else ""
    return Device.parse(uuid) if uuid else Device("cpu")


def unavailable(reason: str, strict: bool) -> None:
    """Raise CompileArtifactsUnavailable when ``strict``, else log ``reason`` as one warning."""
    if strict:
        raise CompileArtifactsUnavailable(reason)
    log.warning("weightcache: compile artifacts: %s", reason)


def _triton_version() -> str:
    for distribution in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"
