"""A sender for tests/core/test_seeding.py that can die mid-way or lie:
``python -m tests.core.seed_sender SOCKET_DIR FINGERPRINT_JSON [N | LIE]``.

It joins the gloo group from the torchrun-style environment and sends the entry
``FINGERPRINT_JSON`` names from the server at ``SOCKET_DIR``. With ``N`` it
SIGKILLs itself once the header and ``N`` arena broadcasts have gone out (the
broadcasts are counted by wrapping ``torch.distributed.broadcast``, not our code).
With ``LIE`` (one of ``LIES``) it is a peer that lies to the receiver: the sending
side of the seeding is changed here, the receiving side under test is not. With
``WC_SEED_DEVICE=cuda:N`` in its environment it sends a GPU entry over NCCL.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch.distributed as dist

from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node import seeding
from weightcache.core.node.seeding import send_entry

HEADER_BROADCASTS = 2  # the header's length, then the header


def die_after(arenas: int) -> None:
    real, sent = dist.broadcast, [0]

    def broadcast(*args, **kwargs):
        if sent[0] == HEADER_BROADCASTS + arenas:
            os.kill(os.getpid(), signal.SIGKILL)
        sent[0] += 1
        return real(*args, **kwargs)

    dist.broadcast = broadcast


def flip_a_byte() -> None:
    """Send other bytes than the declared checksums say: one byte in the middle of every arena flipped."""
    real = seeding.TorchDistributedLink.broadcast_arena

    def broadcast_arena(self, view):
        other = view.clone()
        other[other.numel() // 2] ^= 0xFF
        real(self, other)

    seeding.TorchDistributedLink.broadcast_arena = broadcast_arena


def change_header(change) -> None:
    """Declare another manifest than the entry's: ``change(manifest_json)`` edits it before it is sent."""
    real = seeding.TorchDistributedLink.send_json

    def send_json(self, value):
        if "manifest" in value:
            change(value["manifest"])
        real(self, value)

    seeding.TorchDistributedLink.send_json = send_json


def _inflate(manifest: dict) -> None:
    manifest["arenas"][0]["size"] = 1 << 40  # a 1 TiB arena for tensors of a few KiB


def _ghost_tensor(manifest: dict) -> None:
    """A 1 TiB arena that a 1 TiB tensor fills: plausible for its tensors, but no node here can hold it."""
    manifest["arenas"][0]["size"] = 1 << 40
    ghost = {**manifest["tensors"][0], "name": "ghost", "dtype": "uint8", "shape": [1 << 40], "stride": [1]}
    manifest["tensors"].append({**ghost, "offset": 0, "storage_offset": 0, "nbytes": 1 << 40})


def _shrink(manifest: dict) -> None:
    manifest["arenas"][0]["size"] = 4096  # smaller than its tensors reach


LIES = {
    "bytes": flip_a_byte,
    "inflated": lambda: change_header(_inflate),
    "ghost": lambda: change_header(_ghost_tensor),
    "shrunk": lambda: change_header(_shrink),
}


def main() -> int:
    socket_dir, fingerprint = sys.argv[1], Fingerprint.from_json(json.loads(sys.argv[2]))
    if len(sys.argv) > 3:
        if sys.argv[3] in LIES:
            LIES[sys.argv[3]]()
        else:
            die_after(int(sys.argv[3]))
    device = os.environ.get("WC_SEED_DEVICE")  # a GPU entry: NCCL from that GPU (tests/gpu/test_seeding_gpu.py)
    if device:
        import torch

        torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        report = send_entry(fingerprint, socket_dir)
    finally:
        dist.destroy_process_group()
    print(report.summary(int(os.environ["RANK"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
