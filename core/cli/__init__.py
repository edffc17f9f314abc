"""The ``weightcache`` command line: its subcommands, the options they share, one line per mistake, the demo."""

from weightcache.core.old_paths import old_names

__getattr__ = old_names(__name__)  # the names 0.1.0's module weightcache.core.cli had, warning
