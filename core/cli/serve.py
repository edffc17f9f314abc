"""``weightcache serve``: its options, the settings read from them and the config file, ``--check-config``."""

from __future__ import annotations

import argparse
import pathlib

from weightcache.core.cli.cli_options import Commands, add_command, add_log_options, add_socket_dir, bounded, size
from weightcache.core.server.bounds import CONNECTIONS, IDLE_SECONDS, PORT, SECONDS, SIZE_EXAMPLE

DETACHED_LOG = "server.log"
"""Where ``serve --detach`` logs unless ``--log-file`` says otherwise: this file in the socket directory."""

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
  0  stopped by SIGTERM or SIGINT, or handed every entry to a successor; --check-config: no error (warnings or not)
  1  could not start: a bad config file or value, a listener that cannot bind, another server on the
     directory, a successor that refused the handover (one `weightcache: error:` line says which);
     --check-config: an error (a line each, e.g. a warm item whose model is not there)
  2  usage error (an unknown option or a bad value on the command line)

metrics port (--metrics-port): /metrics (Prometheus), /healthz (the server accepts), /readyz (it listens and
is not handing over). Details: docs/operations.md."""


def add_parser(commands: Commands) -> None:
    """``serve`` and its options."""
    serve = add_command(
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
        help="check what a start would do (values, the metrics host, each warm item's model, adapter and options, the "
        "budgets against this machine), print the settings and a line per problem, and exit without serving: 0 no "
        "error, 1 an error (same as `weightcache check-config`)",
    )
    serve.add_argument(
        "--take-over",
        action="store_true",
        help="restart or upgrade: take every entry, the socket and the lock from the server running on this directory, "
        "which exits once this one serves (without one running: start as usual); under systemd send the running server "
        "SIGUSR2 instead: it starts its own successor inside the unit",
    )
    _add_connection_options(serve)


def _add_connection_options(serve: argparse.ArgumentParser) -> None:
    """What bounds the server's connections, and its metrics endpoint."""
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


def run(args: argparse.Namespace) -> int:
    """Serve with the flags over the config file's settings (or check them, or serve detached)."""
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
    """``serve --check-config``: ``weightcache check-config`` with the flags over the file."""
    from weightcache.core.cli.check_config import report

    shown = {
        "log_level": args.log_level or logged.get("log_level", "info"),
        "log_format": args.log_format or logged.get("log_format", "text"),
    }
    return report("weightcache serve", config, warm, shown, args.config)
