"""``weightcache fleet``: a node's part in a fleet that finds entries through etcd and pulls them over NIXL.

    weightcache fleet share [--socket-dir S]     share this node's entries (runs beside the server)
    weightcache fleet list                       what the registry lists: contents, holders, claims, relays, readers

The fleet is named by the environment (``WEIGHTCACHE_FLEET_ETCD``, the shared secret in
``WEIGHTCACHE_FLEET_SECRET_FILE``, ``WEIGHTCACHE_FLEET_NODE``; docs/operations.md, "A fleet").
With it set, ``weightcache load`` and an engine in ``daemon`` mode that miss locally pull
from a node that holds the entry before they read the disk.

Registered under the ``weightcache.commands`` entry points.
"""

from __future__ import annotations

import argparse
import signal
import threading

from weightcache.core.cli.cli_options import add_socket_dir, help_text


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "fleet",
        help="share this node's entries with a fleet (etcd registry, NIXL transfers), or list what the fleet holds",
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="fleet_command", required=True, metavar="ACTION", help="what to do")
    share = actions.add_parser("share", help="share this node's entries until the server stops (run beside the server)")
    add_socket_dir(share)
    share.add_argument("--transport", default="nixl", help="how peers read the arenas (default: nixl)")
    actions.add_parser("list", help="list the contents the registry knows, their holders, claims, relays and readers")
    return parser


def run(args: argparse.Namespace) -> int:
    from weightcache.core.node.fleet.config import ENV_ETCD, FleetConfig

    config = FleetConfig.from_env()
    if config is None:
        raise ValueError(f"{ENV_ETCD} is not set: name the fleet's etcd endpoints there (docs/operations.md, 'A fleet')")
    if args.fleet_command == "list":
        return _list(config)
    from weightcache.core.node.fleet.share import Sharer

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    sharer = Sharer(config, args.socket_dir, args.transport)
    print(f"node {config.node}: sharing the entries of {args.socket_dir or 'the default socket directory'}", flush=True)
    return sharer.run(stop)


def _list(config) -> int:
    from weightcache.core.node.fleet.records import Claim, Content, FileContent, Holding, Relay, opened
    from weightcache.core.node.fleet.registry import FleetRegistry

    registry = FleetRegistry(config)
    kinds = {
        "content": Content,
        "holders": Holding,
        "claims": Claim,
        "relays": Relay,
        "readers": Claim,
        "files": FileContent,
        "sightings": Claim,
    }
    for item in registry.store.range(config.key("")):
        name = item.key.decode(errors="replace")
        kind = name[len(config.prefix) + 1 :].split("/", 1)[0]
        if kind not in kinds:
            print(f"{name}: INVALID (not a key of this version)")
            continue
        try:
            record = opened(item.key, item.value, config.secret, kinds[kind].from_json)  # type: ignore[attr-defined]
        except ValueError as exc:
            print(f"{name}: INVALID ({str(exc)[:200]})")
            continue
        if isinstance(record, FileContent):
            print(f"{name}: a weight file of {record.seen.size} bytes, hashed by node {record.origin}")
            continue
        if isinstance(record, Holding):
            print(
                f"{name}: {record.fingerprint.short} tier {record.fingerprint.gpu_uuid or 'cpu'}, {sum(r.length for r in record.arenas)} bytes over {record.transport}"
            )
        elif isinstance(record, Content):
            print(f"{name}: {len(record.arenas)} arenas, {record.nbytes} bytes, first published by node {record.origin}")
        elif isinstance(record, Relay):
            landing = record.landing
            landed = "" if landing is None else f", and arena {landing.arena} as it lands ({landing.landed} bytes so far)"
            print(f"{name}: node {record.node} pulls it and serves the {record.verified} arenas it has checked{landed}")
        elif kind == "readers":
            print(f"{name}: node {record.node} reads from this holder")
        elif kind == "sightings":
            print(f"{name}: node {record.node} reads a checkpoint nobody has hashed yet")
        else:
            print(f"{name}: node {record.node} reads it from the disk")
    return 0
