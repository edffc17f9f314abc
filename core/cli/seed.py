"""``weightcache seed``: the command that seeds a node from a peer node, on every rank (``weightcache.core.node.seeding``
moves the bytes; its docstring is this command's ``--help``).

Registered under the ``weightcache.commands`` entry points. Kept apart from the broadcast because it reads the command
line and names the sender's entry the way ``weightcache load`` does (``loader.prepare``), which sit above the node's
copies: the broadcast imports neither.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from weightcache.core.cli.cli_options import add_timeout, help_text
from weightcache.core.device import Device
from weightcache.core.errors import SeedFailed
from weightcache.core.node import seeding
from weightcache.core.node.seeding import first_line

DEPRECATED = (
    "weightcache: `weightcache seed` is deprecated and will be removed in the next release: run `weightcache fleet share` "
    "beside each server and set WEIGHTCACHE_FLEET_ETCD; `weightcache load` then pulls from a peer node "
    "(docs/operations.md, 'A fleet')"
)


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "seed",
        help="(deprecated: use `weightcache fleet`) copy an entry from a peer node's server into this node's through "
        "torch.distributed (run on every rank)",
        description=help_text(seeding.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from weightcache.core.cli.cli_options import add_request_options

    add_request_options(  # the sender names its entry the way it was loaded
        parser,
        model_required=False,
        model_help="the sender's checkpoint directory, as it was loaded (receivers need none and ignore it)",
    )
    parser.add_argument(
        "--src-rank", type=int, default=0, metavar="RANK", help="the rank that holds the entry and sends it (default: 0)"
    )
    add_timeout(
        parser,
        seeding.DEFAULT_TIMEOUT_S,
        "longest wait for the rendezvous and for each broadcast; a sender that dies fails every receiver",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from weightcache.core.cli.cli_options import load_request
    from weightcache.core.flow.loader import prepare
    from weightcache.core.progress import note

    print(DEPRECATED, file=sys.stderr, flush=True)
    rank, world_size = _rendezvous_environment()
    if not 0 <= args.src_rank < world_size:
        raise ValueError(f"--src-rank {args.src_rank} is not a rank of this run (WORLD_SIZE={world_size})")
    device = Device.parse(args.device)
    sender = rank == args.src_rank
    fingerprint = None
    if sender:
        if not args.model:
            raise ValueError(
                f"rank {rank} sends (--src-rank): name its entry with --model DIR and the options it was loaded with"
            )
        note(f"rank {rank}: identifying {args.model} ...")
        fingerprint = prepare(load_request(args)).fingerprint  # before the rendezvous: a first hash of the weights takes a while
    if device.is_cuda:
        torch.cuda.set_device(device.torch())
        # A timed-out collective aborts the communicator and raises in the waiting thread (2: CleanUpOnly) instead of
        # the watchdog taking the process down; broadcasts never use NVLink multicast, so NCCL sets none up.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    timeout = datetime.timedelta(seconds=args.timeout)
    note(f"rank {rank}: waiting for {world_size} ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} ...")
    try:
        if device.is_cuda:
            dist.init_process_group("nccl", timeout=timeout, device_id=device.torch())
        else:
            dist.init_process_group("gloo", timeout=timeout)
    except RuntimeError as exc:  # torch's DistError family: a rank that never came, an address nobody listens on
        raise SeedFailed(
            args.src_rank,
            f"the rendezvous of {world_size} ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} did not "
            f"complete within {args.timeout:g} s ({first_line(exc)})",
        ) from None
    try:
        if fingerprint is not None:  # the sender's, named above
            report = seeding.send_entry(fingerprint, args.socket_dir, src=args.src_rank, timeout_s=args.timeout)
        else:
            report = seeding.receive_entry(args.socket_dir, device, src=args.src_rank, timeout_s=args.timeout)
    finally:
        dist.destroy_process_group()
    print(report.summary(rank), flush=True)
    return 0


def _rendezvous_environment() -> tuple[int, int]:
    """RANK and WORLD_SIZE; ValueError naming what is missing (torchrun sets all four variables)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set; run `weightcache seed` on every rank under torchrun, "
            "or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (see docs/operations.md)"
        )
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(
            f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be whole numbers"
        ) from None
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world_size}: seeding needs at least two ranks, RANK from 0 to WORLD_SIZE-1")
    return rank, world_size
