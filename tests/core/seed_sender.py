"""A sender for tests/core/test_seeding.py that can die mid-way: ``python -m tests.core.seed_sender SOCKET_DIR FINGERPRINT_JSON [N]``.

It joins the gloo group from the torchrun-style environment and sends the entry
``FINGERPRINT_JSON`` names from the server at ``SOCKET_DIR``. With ``N`` it
SIGKILLs itself once the header and ``N`` arena broadcasts have gone out (the
broadcasts are counted by wrapping ``torch.distributed.broadcast``, not our code).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch.distributed as dist

from weightcache.core.fingerprint import Fingerprint
from weightcache.core.seeding import send_entry

HEADER_BROADCASTS = 2  # the header's length, then the header


def die_after(arenas: int) -> None:
    real, sent = dist.broadcast, [0]

    def broadcast(*args, **kwargs):
        if sent[0] == HEADER_BROADCASTS + arenas:
            os.kill(os.getpid(), signal.SIGKILL)
        sent[0] += 1
        return real(*args, **kwargs)

    dist.broadcast = broadcast


def main() -> int:
    socket_dir, fingerprint = sys.argv[1], Fingerprint.from_json(json.loads(sys.argv[2]))
    if len(sys.argv) > 3:
        die_after(int(sys.argv[3]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        report = send_entry(fingerprint, socket_dir)
    finally:
        dist.destroy_process_group()
    print(report.summary(int(os.environ["RANK"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
