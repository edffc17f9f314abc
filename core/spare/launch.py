"""The ``weightcache launch`` command as the ``weightcache.commands`` entry point names it; the command and its client
are ``weightcache.core.cli.launch``, which the ``weightcache`` script runs without looking the entry points up."""

from weightcache.core.cli.launch import add_parser as add_parser
from weightcache.core.cli.launch import run as run
