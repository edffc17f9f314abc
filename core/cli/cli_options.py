"""Pieces the subcommands' parsers share: a description from a docstring, ``--timeout``, ``--socket-dir``, the options naming one model rank (and ``load_request``, which reads them back), the argparse types.

Kept apart from ``weightcache.core.cli.cli`` so that subcommands added through entry points (seed, standby,
verify) use them without importing the command-line entry point itself.
"""

from __future__ import annotations

import argparse
import re
import typing

from weightcache.core.options import parse_options
from weightcache.core.server.bounds import Bound, parse_size
from weightcache.core.socket_dir import SocketDir

if typing.TYPE_CHECKING:
    from weightcache.core.device import Device
    from weightcache.core.request import LoadRequest

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):`~?([^`]+)`")
_FIELD = re.compile(r"^\s*:(?:param|returns?|raises?)\b[^\n]*(?:\n(?!\s*:)[ \t]+\S[^\n]*)*\n?", re.MULTILINE)

Commands: typing.TypeAlias = "argparse._SubParsersAction[typing.Any]"
"""The subcommands' parsers of ``weightcache``, to which each command adds its own."""


def help_text(docstring: str | None) -> str:
    """A module docstring as ``--help`` prints it: reST roles and double backquotes made plain, field lists dropped."""
    text = _FIELD.sub("", docstring or "")
    text = _ROLE.sub(lambda match: match.group(1).rsplit(".", 1)[-1], text)
    text = text.replace("``", "")
    return text.strip() + "\n"


def add_timeout(parser: argparse.ArgumentParser, default: float, what: str) -> None:
    """``--timeout SECONDS`` (``args.timeout``): the one spelling of a deadline; ``--timeout-s`` stays a hidden alias."""
    parser.add_argument(
        "--timeout", type=float, default=default, metavar="SECONDS", help=f"{what}, in seconds (default: {default:g})"
    )
    parser.add_argument("--timeout-s", dest="timeout", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


DTYPES = ("auto", "bfloat16", "float16", "float32")


def size(text: str) -> int:
    """A byte count, more than 0 (``bounds.parse_size``: ``64G``, ``64Gi``, ``64GiB`` are 64 × 2^30, ``64GB`` 64 × 10^9)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bounded(bound: Bound, zero: str | None = None) -> typing.Callable[[str], float | int]:
    """An argparse ``type=`` for a number in ``bound`` (``zero``: what 0 stands for, where the flag accepts it)."""

    def parse(text: str) -> float | int:
        try:
            return bound.parse(text, zero)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = bound.unit
    return parse


def at_least(least: int) -> typing.Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
        return value

    parse.__name__ = "count"
    return parse


def parse_device(text: str) -> "Device":
    from weightcache.core.device import Device

    try:
        return Device.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_socket_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket-dir",
        type=SocketDir.parse,
        metavar="DIR",
        help="the server's private directory (default: $WEIGHTCACHE_SOCKET_DIR, "
        "$XDG_RUNTIME_DIR/weightcache or /tmp/weightcache-UID)",
    )


def add_request_options(
    parser: argparse.ArgumentParser,
    *,
    model_required: bool = True,
    model_help: str = "checkpoint directory (config.json and *.safetensors)",
) -> None:
    """The options that name one model rank as ``weightcache load`` takes them (``load_request`` reads them back)."""
    add_socket_dir(parser)
    parser.add_argument(
        "--adapter", default="hf", help="adapter that reads the checkpoint (default: hf, Hugging Face transformers)"
    )
    parser.add_argument("--model", required=model_required, metavar="DIR", help=model_help)
    parser.add_argument(
        "--revision",
        metavar="REV",
        help="with a hub id as --model (org/name): the branch, tag or commit, resolved offline from the local hub cache "
        "as transformers does (default: main)",
    )
    parser.add_argument("--dtype", choices=DTYPES, help="dtype of unquantized weights (default: auto, the checkpoint's own)")
    parser.add_argument(
        "--device",
        type=parse_device,
        default="cpu",
        help="where the arenas live: cpu, cuda, cuda:N or a GPU UUID as nvidia-smi -L prints it (default: cpu)",
    )
    parser.add_argument(
        "--quant",
        metavar="METHOD",
        help="quantize while loading: fp8-block (block-wise FP8, the one method validated for caching)",
    )
    parser.add_argument(
        "--model-class", metavar="CLASS", help="transformers class to build (default: the checkpoint's architecture)"
    )
    parser.add_argument(
        "--tp-size",
        type=at_least(1),
        default=1,
        metavar="N",
        help="tensor-parallel size: how many ranks share the model (default: 1)",
    )
    parser.add_argument(
        "--tp-rank",
        type=at_least(0),
        default=0,
        metavar="RANK",
        help="the rank this load is for, 0 to --tp-size minus 1 (default: 0)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an adapter option (repeatable); a JSON value is decoded, e.g. --option block_size=[128,128]",
    )


def load_request(args: argparse.Namespace) -> "LoadRequest":
    from weightcache.core.fingerprint import ParallelSpec
    from weightcache.core.identity import hub
    from weightcache.core.request import LoadRequest

    if args.tp_rank >= args.tp_size:
        raise ValueError(
            f"--tp-rank {args.tp_rank} does not fit --tp-size {args.tp_size}; give a rank from 0 to {args.tp_size - 1}"
        )
    options = parse_options(args.option)
    if args.model_class:
        options["model_class"] = args.model_class
    where = hub.require_cached(hub.resolve(args.model, args.revision))  # the CLI has no engine load to fall back to
    return LoadRequest(
        model=where.path,  # the snapshot directory: the revision is resolved
        adapter=args.adapter,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quant,
        parallel=ParallelSpec(tp_size=args.tp_size, tp_rank=args.tp_rank),
        options=options,
    )


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


def add_command(commands: Commands, name: str, text: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser: ``text`` is its one-line help and, capitalised, its description."""
    return commands.add_parser(
        name,
        help=text,
        description=text[0].upper() + text[1:] + ".",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter if epilog else argparse.HelpFormatter,
    )
