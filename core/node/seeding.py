"""Seeding a new node from a peer node: an entry's arenas broadcast through ``torch.distributed``, published whole or not at all.

    weightcache seed --socket-dir S [--device D] [--src-rank N] [--timeout T] [--model DIR and the load options]

Run it on every rank (one process per node, e.g. under ``torchrun``); the rendezvous
is torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).
Rank ``--src-rank`` holds the entry in its node's server and names it as
``weightcache load`` does (``--model DIR`` and the options it was published with);
the other ranks need no checkpoint: they receive the arenas on ``--device`` and
publish them into their own node's server. NCCL between GPUs, gloo between hosts.

Every rank takes part in each step, in this order:

1. header: the sender's fingerprint, manifest and label as JSON in a uint8 tensor
   (its length first; no pickle, which ``broadcast_object_list`` would unpickle);
2. verdict: each rank says whether it can take the entry (one flag per rank, summed):
   a receiver whose torch, CUDA or GPU kind differs (``check_environment``), whose
   server does not answer, whose server's budget or device's free memory cannot hold
   the declared arenas, that is sent arenas larger than their tensors need
   (``check_sizes``) or whose arenas cannot be made refuses, and every rank stops
   before a byte of weights moves;
3. the arenas, whole, in broadcasts of at most ``CHUNK_BYTES``;
4. a completion marker (a magic number and the byte count).

A receiver publishes only after step 4, and only if every arena's bytes match the
checksum the sender's manifest declares for it (ChecksumMismatch names the arena);
any failure before (a sender that dies or stalls: every collective waits at most the
timeout) closes its arenas, so nothing partial or unchecked is ever published.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import time
import typing

import attrs

from weightcache.core.arena.base import plausible_size
from weightcache.core.device import Device
from weightcache.core.errors import InvalidManifest, SeedFailed, SeedRefused
from weightcache.core.fingerprint import HOST_TIER, Fingerprint
from weightcache.core.load import preflight
from weightcache.core.node.backends import CopyBackend, backend_class
from weightcache.core.socket_dir import SocketDir
from weightcache.core.wire.protocol import MAX_FRAME_BYTES

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.layout.manifest import Manifest

log = logging.getLogger(__name__)

CHUNK_BYTES: typing.Final = 1 << 30
"""Largest single broadcast: whole arenas of the default size, few messages, every one big enough for full bandwidth."""
MAX_HEADER_BYTES: typing.Final = MAX_FRAME_BYTES
"""A manifest larger than one frame could not be published anyway."""
DEFAULT_TIMEOUT_S: typing.Final = 600.0
SEED_FORMAT: typing.Final = 1
_DONE: typing.Final = 0x5EED_D0E5


@attrs.frozen
class SeedReport:
    """What one rank did: ``role`` (``sender`` or ``receiver``), the entry's digest, the weight bytes moved and how long it took.

    ``created``: a receiver's publish created the entry (False: its server held it already).
    """

    role: str
    digest: str
    bytes: int
    seconds: float
    created: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self, rank: int) -> str:
        """The one line ``weightcache seed`` prints."""
        from weightcache.core.progress import format_bytes

        verb = "sent" if self.role == "sender" else ("received and published" if self.created else "received (already held)")
        return (
            f"rank {rank}: {verb} {self.digest[:12]}: {format_bytes(self.bytes)} in {self.seconds:.2f} s "
            f"({self.gb_per_s:.2f} GB/s)"
        )


def check_environment(fingerprint: Fingerprint, device: "Device | str") -> Fingerprint:
    """The fingerprint of ``fingerprint``'s entry held on this process's ``device``.

    The bytes stay valid only where torch, CUDA, the GPU kind and the protocol are the
    same (every field of ``identity.Environment`` but the GPU's UUID); a GPU entry is
    renamed for this GPU (``Fingerprint.on_device``), a host entry kept as it is.

    :raises SeedRefused: naming each field that differs, with both values.
    """
    from weightcache.core.identity.identity import Environment

    device = Device.parse(device)
    here = Environment.of(device)
    fields = [
        f.name
        for f in attrs.fields(Environment)
        if f.name != "gpu_uuid" and getattr(fingerprint, f.name) != getattr(here, f.name)
    ]
    if fields:
        detail = ", ".join(f"{name} {getattr(fingerprint, name)!r} there, {getattr(here, name)!r} here" for name in fields)
        raise SeedRefused(fingerprint.digest, f"made for another environment ({detail})", fields)
    return fingerprint.on_device(here.gpu_uuid) if device.is_cuda else fingerprint


def send_entry(
    fingerprint: Fingerprint,
    socket_dir: SocketDir | None,
    *,
    src: int = 0,
    group: "torch.distributed.ProcessGroup | None" = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SeedReport:
    """Broadcast the entry ``fingerprint`` names, from this node's server, to every other rank of ``group``.

    ``group`` (default: the default group) must be initialised, with NCCL for a GPU's
    entry (after ``torch.cuda.set_device`` to its GPU) or gloo for a host entry; this
    process must be rank ``src``. Each collective waits at most ``timeout_s``.

    :raises SeedFailed: a receiver refused, or the transfer broke off.
    """
    from weightcache.core.client.attach import Attachment

    link = backend_class("torch_distributed", TorchDistributedLink)(group, src, timeout_s)
    if link.rank != src:
        raise ValueError(f"send_entry runs on rank {src} (src), not on rank {link.rank}")
    start = time.perf_counter()
    try:
        attachment = Attachment.open(fingerprint, socket_dir)
    except Exception as exc:
        link.send_json({"error": str(exc)})  # the receivers stop now instead of waiting out the timeout
        raise
    with contextlib.closing(attachment):
        manifest = attachment.manifest
        link.send_json(
            {
                "format": SEED_FORMAT,
                "fingerprint": attachment.fingerprint.to_json(),
                "manifest": manifest.to_json(),
                "label": attachment.label,
            }
        )
        link.expected = sum(spec.size for spec in manifest.arenas)
        _agree(link, refusal=None)
        for arena in attachment.arenas:
            link.broadcast_arena(arena.bytes_view())
        link.broadcast(link.tensor([_DONE, link.moved]), "the completion marker")
    return SeedReport("sender", attachment.digest, link.moved, time.perf_counter() - start)


def receive_entry(
    socket_dir: SocketDir | None,
    device: "Device | str",
    *,
    src: int = 0,
    group: "torch.distributed.ProcessGroup | None" = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SeedReport:
    """Receive the entry rank ``src`` broadcasts into arenas on ``device`` and publish it into the server at ``socket_dir``.

    ``group`` as for :func:`send_entry` (NCCL: ``torch.cuda.set_device(device)`` first).
    Nothing is published unless every arena and the completion marker arrived.

    :raises SeedRefused: this node cannot use the entry (``check_environment``, ``check_sizes``).
    :raises NoRoom, NoMemory: the server's budget or the device cannot hold it (before anything is allocated).
    :raises ChecksumMismatch: an arena's bytes are not those the sender declared.
    :raises SeedFailed: the sender could not send, another rank refused, or the transfer broke off.
    """
    import torch

    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.load.publish import publish_arenas

    device = Device.parse(device)
    link = backend_class("torch_distributed", TorchDistributedLink)(group, src, timeout_s)
    start = time.perf_counter()
    header = link.receive_json()
    if "error" in header:  # the sender stopped before the verdict: no rank votes
        raise SeedFailed(src, f"the sender could not send the entry: {header['error']}")
    with ArenaBuilder(device) as builder:
        try:
            fingerprint, manifest, label = _accept(header, device, socket_dir, src)
            link.expected = sum(spec.size for spec in manifest.arenas)
            slots = [builder.add_arena(spec.size) for spec in manifest.arenas]
            for slot in slots:
                builder.view(slot)  # make every arena now: no room here is a refusal, before a byte moves
        except Exception as exc:
            _agree(link, refusal=exc)
            raise
        _agree(link, refusal=None)
        for slot in slots:
            link.broadcast_arena(builder.view(slot))
        marker = link.tensor([0, 0])
        link.broadcast(marker, "the completion marker")
        if marker.tolist() != [_DONE, link.expected]:
            raise SeedFailed(src, f"the completion marker says {marker.tolist()}, expected {[_DONE, link.expected]}")
        if device.is_cuda:
            torch.cuda.synchronize(device.torch())
        # The sender's manifest declares each arena's checksum: what arrived must match it, else nothing is published.
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label, copied_from=f"rank {src}")
    seconds = time.perf_counter() - start
    return SeedReport("receiver", reply.digest, link.moved, seconds, created=reply.created)


def _accept(header: dict, device: Device, socket_dir: SocketDir | None, src: int):
    """The fingerprint (for this node), manifest and label of a header this node can use; raises why it cannot."""
    from weightcache.core.client.client import Connection
    from weightcache.core.client.replies import ServerStatus
    from weightcache.core.layout.manifest import Manifest

    if header.get("format") != SEED_FORMAT:
        raise SeedFailed(
            src, f"the sender speaks seed format {header.get('format')!r}, this node {SEED_FORMAT}; run one weightcache version"
        )
    fingerprint = check_environment(Fingerprint.from_json(header["fingerprint"]), device)
    try:
        manifest = Manifest.from_json(header["manifest"])  # refuses tensors outside their arenas
    except InvalidManifest as exc:
        raise SeedRefused(fingerprint.digest, f"the sender's manifest is not usable ({exc})") from None
    check_sizes(manifest, fingerprint.digest)
    needed = manifest.nbytes
    with Connection(socket_dir) as connection:
        status = ServerStatus.from_json(connection.status())  # no server here: refuse now, not after the transfer
    preflight.check_room(status, needed, tier=HOST_TIER if not device.is_cuda else fingerprint.gpu_uuid)
    preflight.check_memory(device, needed)
    return fingerprint, manifest, str(header.get("label") or "")


def check_sizes(manifest: "Manifest", digest: str) -> None:
    """Refuse (SeedRefused) arenas a sender declares larger than their tensors need, or without a checksum.

    Each arena may exceed the end of its last tensor by an allocation granule only
    (``plausible_size``, the rule the server applies to a CUDA arena), so a declared
    size is backed by tensors before anything is allocated for it.
    """
    for index, (spec, extent) in enumerate(zip(manifest.arenas, manifest.arena_extents(), strict=True)):
        if spec.size > plausible_size(extent):
            raise SeedRefused(
                digest,
                f"the sender declares arena {index} of {spec.size} bytes, but its tensors reach only {extent} "
                f"(at most {plausible_size(extent)} are plausible)",
            )
        if spec.checksum is None:
            raise SeedRefused(digest, f"the sender declares no checksum for arena {index}; its bytes could not be checked")


def _agree(link: "TorchDistributedLink", refusal: BaseException | None) -> None:
    """Every rank says whether it takes the entry; SeedFailed on the others when one refuses (the refuser raises its own error)."""
    refused = link.verdict(refusal is not None)
    if refusal is not None:
        return
    if refused:
        names = ", ".join(map(str, refused))
        raise SeedFailed(link.src, f"rank {names} refused the entry (its own output says why); no weights were sent")


class TorchDistributedLink(CopyBackend):
    """The collectives of one seeding: broadcasts from ``src`` to every rank of ``group``, each waiting at most
    ``timeout_s`` (NCCL between GPUs, gloo between hosts)."""

    name: typing.ClassVar[str] = "torch_distributed"
    reach: typing.ClassVar[str] = "group"

    def __init__(self, group, src: int, timeout_s: float):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first (`weightcache seed` does)")
        self.group = group
        self.src = src
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.moved = 0
        self.expected = 0

    def tensor(self, values: list[int]) -> "torch.Tensor":
        import torch

        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def broadcast(self, tensor: "torch.Tensor", what: str) -> None:
        """Broadcast ``tensor`` from ``src``; SeedFailed (naming ``what`` and the bytes so far) when it breaks or times out.

        ``wait`` with a timeout blocks this thread until the collective completed or
        the timeout passed (NCCL aborts its communicator, then raises here).
        """
        import torch.distributed as dist

        try:
            dist.broadcast(tensor, src=self.src, group=self.group, async_op=True).wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise SeedFailed(
                self.src,
                f"{what} did not arrive within {self.timeout.total_seconds():g} s or the link broke "
                f"({self.moved} of {self.expected} weight bytes moved): {first_line(exc)}",
            ) from None

    def broadcast_arena(self, view: "torch.Tensor") -> None:
        for offset in range(0, view.numel(), CHUNK_BYTES):
            chunk = view[offset : offset + CHUNK_BYTES]
            self.broadcast(chunk, f"arena bytes {self.moved}..{self.moved + chunk.numel()}")
            self.moved += chunk.numel()

    def send_json(self, value: dict) -> None:
        import torch

        payload = json.dumps(value, separators=(",", ":")).encode()
        self.broadcast(self.tensor([len(payload)]), "the header's length")
        self.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), "the header")

    def receive_json(self) -> dict:
        import torch

        length = self.tensor([0])
        self.broadcast(length, "the header's length")
        nbytes = int(length.item())
        if not 0 < nbytes <= MAX_HEADER_BYTES:
            raise SeedFailed(
                self.src, f"the header would be {nbytes} bytes (at most {MAX_HEADER_BYTES}); is rank {self.src} seeding?"
            )
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.broadcast(payload, "the header")
        try:
            header = json.loads(payload.cpu().numpy().tobytes())
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise SeedFailed(self.src, "the header is not a JSON object; run one weightcache version on every rank")
        return header

    def verdict(self, refuse: bool) -> list[int]:
        """The ranks that refuse, once every rank has said (this one refuses when ``refuse``)."""
        import torch.distributed as dist

        flags = self.tensor([0] * self.world_size)
        flags[dist.get_rank(self.group)] = int(refuse)
        try:
            dist.all_reduce(flags, group=self.group, async_op=True).wait(timeout=self.timeout)
        except RuntimeError as exc:
            if refuse:
                log.warning("could not tell the other ranks that this one refuses: %s", first_line(exc))
                return []
            raise SeedFailed(self.src, f"the ranks could not agree to start: {first_line(exc)}") from None
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def first_line(exc: BaseException) -> str:
    """The first line of a torch.distributed error (the rest is advice for torch's own developers)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
