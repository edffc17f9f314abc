"""Pieces every subcommand's parser shares: its description from a docstring, and the one ``--timeout`` option.

Kept apart from ``weightcache.core.cli`` so that subcommands added through entry points (seed, standby,
verify) use them without importing the command-line entry point itself.
"""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):`~?([^`]+)`")
_FIELD = re.compile(r"^\s*:(?:param|returns?|raises?)\b[^\n]*(?:\n(?!\s*:)[ \t]+\S[^\n]*)*\n?", re.MULTILINE)


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
