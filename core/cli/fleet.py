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
import logging
import os
import signal
import sys
import threading
import time
import typing

from weightcache.core.cli.cli_options import add_socket_dir, help_text
from weightcache.core.progress import counted

log = logging.getLogger(__name__)


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
    print(f"node {config.node}: sharing the entries of {args.socket_dir or 'the default socket directory'}", flush=True)
    return supervised(lambda: _share(config, args), args.verbose)


def _share(config, args: argparse.Namespace) -> int:
    """The sharing agent itself (in the supervisor's child): share until the server stops or a signal says stop."""
    from weightcache.core.node.fleet.share import Sharer

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return Sharer(config, args.socket_dir, args.transport).run(stop)


RESTARTS_PER_MINUTE = 5
"""A sharing agent that dies of a signal more often than this in a minute is not started again."""


def supervised(work: typing.Callable[[], int], verbose: bool = False) -> int:
    """Run ``work`` (the sharing agent) in a child process, and start it again when it dies of a signal.

    NIXL authenticates nobody: a peer that reaches the agent's NIXL port with its metadata (in etcd, signed, not
    secret) can post a write into the arenas it shares, which are mapped read-only there, and UCX's thread dies of
    SIGSEGV in the agent. The arenas are untouched; the agent is started again (its records under a new lease), and
    docs/operations.md says how to keep NIXL's port inside the fleet's network. The child dies with this process
    (``PR_SET_PDEATHSIG``); SIGTERM and SIGINT are passed on to it, and its exit status is this command's.
    """
    from weightcache.core.cli.reporting import reporting_errors

    child, stopping = 0, False
    deaths: list[float] = []

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child:
            os.kill(child, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    while True:
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                _die_with_parent()
                code = reporting_errors(work, verbose)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        status = os.waitpid(child, 0)[1]
        child = 0
        if os.WIFEXITED(status) or stopping:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        now = time.monotonic()
        deaths = [at for at in deaths if now - at < 60] + [now]
        name = signal.Signals(os.WTERMSIG(status)).name
        if len(deaths) > RESTARTS_PER_MINUTE:
            log.error(
                "weightcache: the sharing agent died of %s %d times within a minute; not starting it again", name, len(deaths)
            )
            return 128 + os.WTERMSIG(status)
        log.warning(
            "weightcache: the sharing agent died of %s (a peer may have written into the memory it shares over NIXL: "
            "keep NIXL's traffic inside the fleet's network, docs/operations.md); starting it again",
            name,
        )


def _die_with_parent() -> None:
    """Ask the kernel to end this process when its parent (the supervisor) ends, however it ends."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: a supervisor killed hard leaves its agent to its lease
        pass
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def _list(config) -> int:
    from weightcache.core.node.fleet.records import Agent, Claim, Content, FileContent, Holding, Relay, opened
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
        "nodes": Agent,
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
        if isinstance(record, Agent):
            print(f"{name}: the sharing agent of node {record.node} (pid {record.pid} on {record.host})")
            continue
        if isinstance(record, Holding):
            print(
                f"{name}: {record.fingerprint.short} tier {record.fingerprint.gpu_uuid or 'cpu'}, {sum(r.length for r in record.arenas)} bytes over {record.transport}"
            )
        elif isinstance(record, Content):
            arenas = counted(len(record.arenas), "arena")
            print(f"{name}: {arenas}, {record.nbytes} bytes, first published by node {record.origin}")
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
